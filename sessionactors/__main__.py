"""``python -m sessionactors``: see ``sessionactors._cli``."""

from ._cli import main

if __name__ == "__main__":
    main()
