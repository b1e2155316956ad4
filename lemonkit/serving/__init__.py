"""What the server runs on, above the engines and below the routes: the model manager and what it shares.

The model manager (``manager``), fair turns and per-user limits (``fairness``), who sent a request
(``caller``), the log history (``log_store``), backend installs (``installer``), stored Responses
(``response_store``), server records and JupyterHub discovery (``server_records``, ``hub_discovery``) and the
recipe pipelines (``recipe_pipelines``, ``voice_pipeline``). ``lemonkit.server`` serves these over HTTP; the
Python client (``lemonkit.client``) uses only the discovery half and never the manager.
"""
