"""Server-owned model downloads: Hugging Face checkpoints into the shared hub cache, resumable and verified.

- :mod:`~lemonkit.downloads.hub_api`: the hub's listing and file metadata, every name it gives checked;
- :mod:`~lemonkit.downloads.job`: one model's job, its state and progress events;
- :mod:`~lemonkit.downloads.fetch`: one file fetched, resumed and verified into the cache;
- :mod:`~lemonkit.downloads.repo_files`: the repo files a pull fetches and a delete removes;
- :mod:`~lemonkit.downloads.state`: ``downloads.json``, the jobs a server leaves for the next;
- :mod:`~lemonkit.downloads.variants`, :mod:`~lemonkit.downloads.updates`: ``/v1/pull/variants``, ``update_available``;
- :mod:`~lemonkit.downloads.downloader`: the jobs of one server, pulls, deletes.
"""

from lemonkit.downloads.downloader import DownloadManager
from lemonkit.downloads.hub_api import Hub, Listing, RemoteFile
from lemonkit.downloads.job import Job, progress_events
from lemonkit.downloads.updates import UpdateChecker
from lemonkit.downloads.variants import list_variants

__all__ = [
    "DownloadManager",
    "Hub",
    "Job",
    "Listing",
    "RemoteFile",
    "UpdateChecker",
    "list_variants",
    "progress_events",
]
