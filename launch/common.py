"""What every entry point shares: one-line errors instead of a traceback wall, config flags."""

import importlib.util
import os
import re
import sys

from absl import app, flags, logging


def run(main, config_flag=None):
    """`absl.app.run(main)`, turning expected failures into `error: ...` and exit status 2.

    With `config_flag` (from `config_flags.DEFINE_config_file`), a bad config file, an unknown
    config key or a value of the wrong type is reported the same way, at start."""
    from starpo.weights import LoadError

    def parse(argv):
        try:
            rest = flags.FLAGS(argv)
            if config_flag is not None and flags.FLAGS["config"].present:
                config_flag.value  # noqa: B018  (loading is lazy: force it here)
            return rest
        except flags.Error as e:
            fail(str(e))
        except (AttributeError, KeyError) as e:
            fail(unknown_key_message(argv, e))
        except (ValueError, TypeError, FileNotFoundError, ImportError, SyntaxError) as e:
            fail(f"config: {e}")

    def wrapped(argv):
        logging.set_verbosity(logging.WARNING)  # JAX's backend probing is noise for users
        try:
            return main(argv)
        except (LoadError, ValueError, FileNotFoundError) as e:
            fail(str(e))

    app.run(wrapped, flags_parser=parse)


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_config_file(spec: str):
    """`path.py[:arg]` -> get_config(arg), without any overrides."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} not found")
    module_spec = importlib.util.spec_from_file_location("_config_module", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def unknown_key_message(argv, error) -> str:
    """Name the `--config.a.b=...` override whose key the config does not have."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None and "--config" in argv[:-1]:
        spec = argv[argv.index("--config") + 1]
    hint = re.search(r'Did you mean "([^"]+)"', str(error))
    hint = f" (did you mean {hint.group(1)}?)" if hint else ""
    try:
        config = load_config_file(spec) if spec else None
    except Exception:  # noqa: BLE001 - only used to word the message
        config = None
    for a in argv:
        m = re.match(r"--config\.([\w.]+)", a)
        if m and config is not None:
            node = config
            for part in m.group(1).split("."):
                if not hasattr(node, "keys") or part not in node.keys():
                    return f"unknown config key {m.group(1)!r}{hint}"
                node = node[part]
    return f"unknown config key{hint}: {str(error).strip(chr(34) + chr(39))}"
