"""Tests of lemonkit.serving: the model manager, fairness, logs and who is calling."""
