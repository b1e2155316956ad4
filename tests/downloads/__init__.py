"""Tests of lemonkit.downloads: the download manager without HTTP."""
