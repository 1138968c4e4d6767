"""What the gateway processes of one host (``kvroute serve --processes N``) share through files in
the run directory: in-flight load, probe results, the host index's ingest."""
