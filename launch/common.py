"""What every launcher shares: the config flag, and one-line errors instead of a traceback wall
(`starpo.cli`, which the benchmarks' and experiments' command lines use too).

    CONFIG = common.define_config("Config file, e.g. configs/frozenlake.py:cpu.")
    ...
    common.run(main, config_flag=CONFIG)

A missing or broken config file, an unknown variant, an unknown key or a value of the wrong type
is reported as `error: ...` with exit status 2 when the flags are parsed, before `main` runs;
`main`'s own expected failures (a bad value, model or workdir) are reported the same way.

A config path that does not exist from the current directory but names one of the `configs`
package's files (`configs/bandit.py:tiny` or `bandit.py:tiny`) is that file: the installed
commands (`starpo-train`, ...) take the README's `--config=` values from any directory.
"""

import os
import re
import sys

from absl import flags
from ml_collections import config_flags

from starpo import cli
from starpo.cli import UsageError, first_line


def define_config(help_text: str, name: str = "config", **kwargs):
    """`--config=FILE[:variant]` plus `--config.a.b=value` overrides (ml_collections;
    `kwargs` go to `DEFINE_config_file`, e.g. flag_values and sys_argv for a parse in-process)."""
    return config_flags.DEFINE_config_file(name, None, help_text, **kwargs)


def run(main, config_flag=None, check_config=False):
    """`absl.app.run(main)`, turning expected failures into `error: ...` and exit status 2
    (`starpo.cli.run`), the config flag parsed here (`parse_flags`).

    check_config: also check every config value (`starpo.config_check`) before `main` runs."""
    cli.run(main, lambda argv: parse_flags(argv, flags.FLAGS, config_flag, check_config))


def parse_flags(argv, flag_values, config_flag=None, check_config=False):
    """Parse `argv` into `flag_values` (the config file loaded, its overrides applied and, with
    `check_config`, every value checked). Returns the remaining arguments; raises UsageError."""
    if config_flag is not None:
        argv = with_packaged_config(argv, config_flag.name)
    try:
        rest = flag_values(argv)
    except flags.UnrecognizedFlagError as e:
        raise UsageError(f"unknown flag --{e.flagname}") from None
    except flags.Error as e:
        raise UsageError(flag_error_message(str(e))) from None
    except (AttributeError, KeyError) as e:  # an override of a key the config lacks
        if "has no attribute 'get_config'" in str(e):  # or a file without get_config()
            raise UsageError(f"config: {config_file(argv, config_flag)} defines no "
                             f"get_config()") from None
        raise UsageError(unknown_key_message(str(e), argv)) from None
    except (SyntaxError, ImportError, ValueError, TypeError, OSError) as e:  # the file's own
        raise UsageError(f"config: {first_line(e)}") from None
    except Exception as e:  # anything else the file's get_config() raised
        raise UsageError(f"config: {config_file(argv, config_flag)}: get_config() raised "
                         f"{type(e).__name__}: {first_line(e)}") from None
    if config_flag is not None and flag_values[config_flag.name].present:
        holder = flag_values[config_flag.name]
        try:
            config = holder.value
            config.keys()  # loading is lazy: a missing file fails only on use
        except OSError as e:
            raise UsageError(f"config file {holder.config_filename} not found or unreadable "
                             f"({str(e).strip().splitlines()[-1].strip()})") from None
        except AttributeError:  # get_config() returned something else
            raise UsageError(f"config: {holder.config_filename}: get_config() returned "
                             f"{type(config).__name__} {config!r:.40}, not a ConfigDict"
                             ) from None
        if check_config:
            from starpo import config_check, run_config

            try:
                config_check.check(config)
            except run_config.ConfigError as e:
                raise UsageError(str(e)) from None
    return rest


def config_file(argv, config_flag) -> str:
    """The FILE of `--config=FILE[:variant]` in `argv` (for messages), or "the config file"."""
    name = config_flag.name if config_flag is not None else "config"
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1].partition(":")[0]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1].partition(":")[0]
    return "the config file"


def workdir_of(value, spec: str, suffix: str = "") -> str:
    """--workdir's value, or where it is not given `default_workdir(spec, suffix)`; an empty
    one is a ValueError (it would otherwise fall back to the default without a word)."""
    if value is None:
        return default_workdir(spec, suffix)
    if not value.strip():
        raise ValueError("--workdir is empty; give a folder or leave the flag out "
                         f"(default {default_workdir(spec, suffix)})")
    return value


def default_workdir(spec: str, suffix: str = "") -> str:
    """runs/<config>[_<variant>]<suffix> for a `FILE[:variant]` spec (launch/train.py's and,
    with suffix `_sft`, launch/sft.py's default --workdir)."""
    path, _, variant = spec.partition(":")
    name = os.path.splitext(os.path.basename(path))[0] + (f"_{variant}" if variant else "")
    return os.path.join("runs", name + suffix)


def packaged_config(spec: str) -> str:
    """`FILE[:variant]`, unchanged if FILE exists (or is absolute or in another folder), else
    with FILE replaced by the `configs` package's file of that name when there is one:
    `configs/bandit.py:tiny` and `bandit.py:tiny` -> `<site-packages>/configs/bandit.py:tiny`."""
    path, sep, variant = spec.partition(":")
    if not path or os.path.isabs(path) or os.path.exists(path):
        return spec
    folder, name = os.path.split(os.path.normpath(path))
    if folder not in ("", "configs"):
        return spec
    import configs

    packaged = os.path.join(os.path.dirname(os.path.abspath(configs.__file__)), name)
    return packaged + sep + variant if os.path.isfile(packaged) else spec


def with_packaged_config(argv, name: str = "config"):
    """`argv` with the value of `--NAME=...` (or `--NAME ...`) passed through packaged_config."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--":
            break
        if arg.startswith(f"--{name}="):
            out[i] = f"--{name}=" + packaged_config(arg.split("=", 1)[1])
        elif arg == f"--{name}" and i + 1 < len(out):
            out[i + 1] = packaged_config(out[i + 1])
    return out


def flag_error_message(text: str) -> str:
    """One line from absl's flag error; a config file's own exception (its traceback is inside
    the message) is reduced to that exception's line, e.g. `unknown config variant 'gpu'`."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if "Traceback (most recent call last):" in lines:
        last = lines[-1]
        kind, sep, message = last.partition(": ")
        return f"config: {message if sep and kind.isidentifier() else last}"
    return lines[0] if lines else "bad flag"


def unknown_key_message(error: str, argv) -> str:
    """`unknown config key 'a.b' (did you mean ...?)` for the `--config.a.b=` override that
    ml_collections failed to find (its error names only the missing part of the key)."""
    overrides = [a[2:].split("=", 1)[0].split(".", 1)[1] for a in argv
                 if a.startswith("--") and "." in a.split("=", 1)[0]]
    looked_up = re.search(r"Attempting to lookup: ([\w.]+)", error)
    missing = re.match(r"""\W*(\w+)""", error)
    key = looked_up.group(1) if looked_up else next(
        (o for o in overrides if missing and missing.group(1) in o.split(".")), None)
    hint = re.search(r'Did you mean "([^"]+)"', error)
    hint = f" (did you mean {hint.group(1)}?)" if hint else ""
    return f"unknown config key {key!r}{hint}" if key else f"unknown config key{hint}: {error}"


def note_accelerator(config_spec: str) -> None:
    """A one-line note where a config variant sized for a GPU (`...py:gpu`) starts on a machine
    whose JAX has none: it runs there too, only slowly."""
    import jax

    variant = config_spec.partition(":")[2].split("+")[0]
    if variant == "gpu" and jax.default_backend() == "cpu" and jax.process_index() == 0:
        print(f"note: {config_spec} is sized for one GPU; JAX sees none here (cpu), so it runs, "
              f"slowly (the :cpu variant is sized for this machine)", flush=True)


def run_job(config, workdir: str, job):
    """A training job (`job()`, e.g. `training.train`) of `config` in `workdir` as every
    process of a run does it: join the other processes of `config.mesh` (a TPU pod slice or
    a cluster) before touching devices, enable the compilation cache, announce the workdir
    (process 0), then run. A run stopped on request (SIGTERM / Ctrl-C to any process: a
    checkpoint is saved) exits with status 75; a failure tells the other processes, which stop
    with a one-line error naming this one (exit status 3) instead of waiting for it."""
    import jax

    from starpo import harness, sharding

    m = config.mesh
    sharding.initialize_distributed(m.distributed, coordinator_address=m.coordinator_address,
                                    num_processes=m.num_processes, process_id=m.process_id,
                                    init_timeout_s=m.init_timeout_s,
                                    heartbeat_timeout_s=m.heartbeat_timeout_s)
    harness.enable_compilation_cache()
    if jax.process_index() == 0:  # on several processes the first one alone prints
        print(f"workdir: {workdir}  (tensorboard --logdir {workdir})")
    try:
        job()
    except harness.Stopped as e:
        sharding.Liveness.finish()
        if jax.process_index() == 0:
            print(f"{e}", file=sys.stderr, flush=True)
        sys.exit(sharding.EXIT_STOPPED)
    except BaseException as e:  # the other processes stop now rather than wait for this one
        if isinstance(e, jax.errors.JaxRuntimeError):  # a collective may have lost a process:
            sharding.Liveness.verdict()  # say which (exit status 3) rather than this error
        expected = isinstance(e, (ValueError, OSError))  # common.run: status 2
        sharding.Liveness.finish(ok=False, exit_code=2 if expected else 1)
        raise
    sharding.Liveness.finish()
