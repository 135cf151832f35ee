"""``python -m sgl_loopkv.launch_server``: see :mod:`sgl_loopkv.server.launch`."""

from sgl_loopkv.server.launch import main

if __name__ == "__main__":
    main()
