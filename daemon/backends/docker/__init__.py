"""The Docker backend (backend.py): containers of a Docker or Podman engine on this host, their
writable layer on the sandbox's capped storage where the node can have it (engine_layer.py)."""
