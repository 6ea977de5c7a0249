"""What every command line of the repository shares (the launchers, benchmarks and experiments):
bad input is one line `error: ...` on stderr and exit status 2, before any work.

    cli.run(main)                             # absl flags: a bad flag, or main's ValueError /
                                              # OSError / LoadError, as one line
    p = cli.ArgParser(description=...)        # argparse, its errors in one line
    a = p.parse_args(argv)
    p.check(a.batch >= 1, f"--batch must be >= 1, got {a.batch}")
    p.model(a.model)                          # a model spec that loads (nothing loaded)

The launchers' config flag and its checks build on `run`: launch/common.py.
"""

import argparse
import sys


class UsageError(Exception):
    """A bad command line or config; the message is one line."""


def fail(message: str):
    """`error: message` on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run(main, parse=None):
    """`absl.app.run(main)`, with one-line errors: `parse(argv)` -> the remaining arguments
    (default: absl's flags parsed), raising UsageError; then `main`'s expected failures (a bad
    value, model, file or folder: ValueError, OSError, LoadError)."""
    from absl import app, flags, logging

    from starpo.weights import LoadError

    def parse_absl(argv):
        try:
            return flags.FLAGS(argv)
        except flags.UnrecognizedFlagError as e:
            raise UsageError(f"unknown flag --{e.flagname}") from None
        except flags.Error as e:
            raise UsageError(first_line(e)) from None

    def parser(argv):
        try:
            return (parse or parse_absl)(argv)
        except UsageError as e:
            fail(str(e))

    def wrapped(argv):
        logging.set_verbosity(logging.WARNING)  # JAX's backend probing is noise for users
        try:
            return main(argv)
        except (LoadError, ValueError, OSError) as e:  # OSError: a folder or file refused
            fail(first_line(e))

    app.run(wrapped, flags_parser=parser)


class ArgParser(argparse.ArgumentParser):
    """argparse's parser whose errors (a wrong type, a missing argument, a failed `check`) are
    one line `error: ...` and exit status 2, without the usage block."""

    def error(self, message):
        fail(message)

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            fail(message)

    def model(self, spec: str, flag: str = "--model") -> None:
        """`spec` names a model that can be loaded (`weights.model_kind`: nothing loaded)."""
        from starpo import weights

        try:
            weights.model_kind(spec)
        except weights.LoadError as e:
            fail(f"{flag}: {first_line(e)}")

    def dtype(self, value: str, flag: str, allowed=("float32", "bfloat16")) -> None:
        self.check(value in allowed, f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
