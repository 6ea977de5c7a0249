"""What every entry point shares: one-line errors instead of a traceback wall."""

import sys

from absl import app, logging


def run(main):
    """`absl.app.run(main)`, turning expected failures into `error: ...` and exit status 2."""
    from starpo.weights import LoadError

    def wrapped(argv):
        logging.set_verbosity(logging.WARNING)  # JAX's backend probing is noise for users
        try:
            return main(argv)
        except (LoadError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    app.run(wrapped)
