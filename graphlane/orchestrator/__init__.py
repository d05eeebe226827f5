"""The daemon: supervises workers, routes requests, serves status and the CLI."""
