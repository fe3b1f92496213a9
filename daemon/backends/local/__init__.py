"""The local backend (backend.py): Linux namespaces on the host made by bubblewrap or util-linux
unshare (launch.py), container images unpacked into cached root filesystems (images.py)."""
