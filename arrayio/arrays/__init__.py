"""Arrays of every framework as bytes: detection through ``sys.modules``, export and
allocation per framework and device, host and device buffers, dtypes, and pytrees."""
