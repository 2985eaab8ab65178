"""CPU-only fast paths (shared-memory bucket transport for gloo ranks on one host, tcmalloc for
CPU ranks). Imported only by the transport, the launcher and the lab; no stage sees them."""
