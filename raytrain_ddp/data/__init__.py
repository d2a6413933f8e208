"""Data: the dataset registry and its checks (registry), transforms, file formats and downloads,
`raytrain data convert`, and the two ingest paths that feed the worker loop (torch_ingest,
ray_ingest), both yielding the Loaders of batches.py."""
