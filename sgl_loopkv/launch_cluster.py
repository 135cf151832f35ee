"""``python -m sgl_loopkv.launch_cluster``: see :mod:`sgl_loopkv.server.cluster`."""

from sgl_loopkv.server.cluster import main

if __name__ == "__main__":
    main()
