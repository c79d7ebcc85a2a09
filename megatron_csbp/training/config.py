"""`--config FILE.yaml`: a YAML mapping of flag names turned into command-line arguments.

Turning the YAML into argv (rather than filling a namespace, as Megatron-LM's `--yaml-cfg` does) keeps
every flag's type, choices, actions and `validate_args` in force.

Keys are flag names without dashes, `seq-length` or `seq_length`; optional `csbp:` / `bdlm:` sections hold
the plugin's flags, with or without their prefix (`bdlm: {block-size: 16}` is `--bdlm-block-size 16`).
Switches take `true`/`false`, multi-value flags a list (or one string of space-separated values), and
`null` leaves a flag at its default.

Precedence, lowest to highest: parser defaults < the YAML < command-line `key=value` overrides < ordinary
command-line flags. So a flag given on the command line always beats the YAML; `key=value` is also the way
to switch off a YAML switch (`bf16=false`) or drop a YAML value (`save=null`).
"""

import argparse
import difflib
import os

import yaml

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training import layer_pattern
from megatron_csbp.training.flags import build_parser

# The types of the per-layer pattern flags, ours and Megatron-LM's (which run the text as Python): their values
# are read here first, by `layer_pattern`, and handed on as a plain list or int.
LAYER_PATTERN_TYPES = ("moe_layer_freq", "window_attn_skip_freq", "linear_attention_freq", "moe_freq_type",
                       "no_rope_freq_type", "la_freq_type")
WINDOW_TYPES = ("window_size", "tuple_type")  # `--window-size`'s type, ours and Megatron-LM's: LEFT,RIGHT
# A section holds the plugin's flags of the prefixes it lists and is named by the first, less its dash: `csbp:`
# holds --csbp-* and --context-block-parallel-*, `bdlm:` holds --bdlm-*.
SECTION_PREFIXES = {prefixes[0][:-1]: prefixes for prefixes in (("csbp-", "context-block-parallel-"), ("bdlm-",))}


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag[2:]: action for flag, action in parser._option_string_actions.items()
            if flag.startswith("--") and flag not in ("--help", "--config")}


def _canonical(key) -> str:
    return str(key).strip().lstrip("-").replace("_", "-")


def _unknown(key: str, known, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else " (see --help for the flag names)"
    return ConfigError(f"{where}: unknown key '{key}'{hint}")


def _resolve_key(key, section: str | None, actions: dict, where: str) -> str:
    name = _canonical(key)
    if name in actions:
        return name
    for prefix in SECTION_PREFIXES.get(section, ()):
        if prefix + name in actions:
            return prefix + name
    raise _unknown(name if section is None else f"{section}.{name}", actions, where)


def _flatten(mapping: dict, actions: dict, where: str) -> dict:
    """Top-level and section keys -> {flag name: value}; a key given twice is an error."""
    flat = {}

    def put(name, value):
        if name in flat:
            raise ConfigError(f"{where}: '{name}' is given twice (spellings and sections count as the same key)")
        flat[name] = value

    for key, value in mapping.items():
        if _canonical(key) in SECTION_PREFIXES and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                put(_resolve_key(sub_key, _canonical(key), actions, where), sub_value)
        else:
            put(_resolve_key(key, None, actions, where), value)
    return flat


def _type_name(action: argparse.Action) -> str:
    return getattr(action.type, "__name__", "string") if action.type else "string"


def _convert(name: str, value, action: argparse.Action, where: str) -> str:
    """One scalar as argparse would receive it, refused here (with the file) if its type or choice is wrong."""
    wanted = _type_name(action)
    if wanted in WINDOW_TYPES and isinstance(value, list) and all(isinstance(x, int) for x in value):
        value = ",".join(map(str, value))  # YAML's [511, 0]
    if wanted in LAYER_PATTERN_TYPES:  # an int or a 0/1 list (YAML's, or a text)
        try:
            value = layer_pattern.canonical(layer_pattern.parse(value if isinstance(value, int) else str(value),
                                                                f"'{name}'"))
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
    if isinstance(value, (list, dict)) or (isinstance(value, bool) and action.type in (int, float)):
        raise ConfigError(f"{where}: '{name}' expects {'a number' if action.type in (int, float) else 'a value'} "
                          f"({wanted}), got {type(value).__name__} {value!r}")
    text = converted = str(value)
    if action.type is not None:
        try:
            converted = action.type(text)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: '{name}' expects {wanted}, got {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: '{name}' is {value!r}; choose one of {', '.join(map(str, action.choices))}")
    return text


def _to_argv(name: str, value, action: argparse.Action, where: str) -> list[str]:
    flag = "--" + name
    if value is None:
        return []
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: '{name}' is a switch; give true or false, got {value!r}")
        if not value and action.const is True and action.default is True:
            raise ConfigError(f"{where}: '{name}' is always on here and cannot be switched off")
        return [flag] if value else []
    if action.nargs is None:
        return [flag, _convert(name, value, action, where)]
    values = value.split() if isinstance(value, str) else value if isinstance(value, list) else [value]
    if isinstance(action.nargs, int) and len(values) != action.nargs:
        raise ConfigError(f"{where}: '{name}' expects a list of {action.nargs} values, got {value!r}")
    if action.nargs == "+" and not values:
        raise ConfigError(f"{where}: '{name}' expects at least one value")
    return [flag, *(_convert(name, item, action, where) for item in values)]


def load_config(path: str, parser: argparse.ArgumentParser | None = None) -> dict:
    """The YAML at `path` as {flag name: value}, every key and value checked against `parser`."""
    parser = parser or build_parser()
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as handle:
            mapping = yaml.safe_load(handle)
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--config {path}: cannot be read ({error})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values at the top level, "
                          f"got a {type(mapping).__name__}")
    actions = _flag_actions(parser)
    flat = _flatten(mapping, actions, path)
    for name, value in flat.items():
        _to_argv(name, value, actions[name], path)
    return flat


def _split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    paths, rest, tokens = [], [], iter(argv)
    for token in tokens:
        if token == "--config":
            paths.append(next(tokens, None))
            if paths[-1] is None:
                raise ConfigError("--config needs a file name: --config FILE.yaml")
        elif token.startswith("--config="):
            paths.append(token.split("=", 1)[1])
        else:
            rest.append(token)
    if len(paths) > 1:
        raise ConfigError(f"--config is given {len(paths)} times ({', '.join(paths)}); give one file")
    return (paths[0] if paths else None), rest


def _overrides(tokens: list[str], actions: dict) -> list[tuple[str, object] | None]:
    """Per token: (flag name, value) for a `key=value` override, None for an ordinary token or a flag's value."""
    found, pending_values = [], 0
    for token in tokens:
        if pending_values and not token.startswith("-"):
            found.append(None)
            pending_values -= 1
            continue
        found.append(_override(token, actions))
        action = actions.get(token[2:]) if token.startswith("--") else None
        nargs = action.nargs if action is not None else 0
        pending_values = 1 if nargs in (None, "?") else nargs if isinstance(nargs, int) else 0
    return found


def _override(token: str, actions: dict) -> tuple[str, object] | None:
    """`key=value` (a known flag name, no leading dash) -> (flag name, YAML-typed value), else None."""
    if token.startswith("-") or "=" not in token:
        return None
    key, text = token.split("=", 1)
    name = _canonical(key)
    if name not in actions:
        if name.replace("-", "").isalnum():
            raise _unknown(name, actions, f"override '{token}'")
        return None
    try:
        return name, yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        return name, text


def _layer_patterns_read(tokens: list[str], actions: dict) -> list[str]:
    """Command-line tokens with each per-layer pattern flag's value (`LAYER_PATTERN_TYPES`) read by
    `layer_pattern` (one line naming the flag if it is not one) and replaced by its plain form, before any
    parser's type sees it."""
    tokens = list(tokens)
    for index, token in enumerate(tokens):
        name, joined, text = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if name not in actions or _type_name(actions[name]) not in LAYER_PATTERN_TYPES:
            continue
        if joined:
            tokens[index] = f"--{name}={layer_pattern.canonical(layer_pattern.parse(text, '--' + name))}"
        elif index + 1 < len(tokens) and not tokens[index + 1].startswith("--"):
            tokens[index + 1] = layer_pattern.canonical(layer_pattern.parse(tokens[index + 1], token))
    return tokens


def expand_argv(argv: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """argv with `--config FILE` and `key=value` overrides expanded into ordinary flags (see module doc), and
    the per-layer pattern flags' values read (`_layer_patterns_read`).

    The result starts with `--config FILE` (so `args.config` records it) when a config was given.
    Works with any parser that has the flags, e.g. Megatron-LM's with `add_csbp_args`.
    """
    parser = parser or build_parser()
    actions = _flag_actions(parser)
    path, rest = _split_config_flag(list(argv))
    mapping = load_config(path, parser) if path else {}
    cli = []
    for token, override in zip(rest, _overrides(rest, actions)):
        if override is None:
            cli.append(token)
        else:
            mapping[override[0]] = override[1]
    expanded = ["--config", path] if path else []
    for name, value in mapping.items():
        expanded += _to_argv(name, value, actions[name], path or "command line")
    return expanded + _layer_patterns_read(cli, actions)


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse argv (default `sys.argv[1:]`) with `--config` and `key=value` overrides; not yet validated.

    `args.config_overridden` lists the YAML keys that a command-line flag or override replaced.
    """
    import sys

    parser = parser or build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(expand_argv(argv, parser))
    path, rest = _split_config_flag(argv)
    yaml_keys = set(load_config(path, parser)) if path else set()
    actions = _flag_actions(parser)
    given = set()
    for token, override in zip(rest, _overrides(rest, actions)):
        if override is not None:
            given.add(override[0])
        elif token.startswith("--"):
            given.add(token[2:].split("=", 1)[0])
    args.config_overridden = sorted(yaml_keys & given)
    return args


def training_loop(argv: list[str]) -> str:
    """`--training-loop` as given on the command line (flag or `key=value`) or in the `--config` YAML, read
    before any parser exists: which parser (ours or Megatron-LM's) reads the rest depends on it."""
    from megatron_csbp.training.flags import TRAINING_LOOPS

    path, rest = _split_config_flag(list(argv))
    value = None
    for index, token in enumerate(rest):
        if token == "--training-loop":
            value = rest[index + 1] if index + 1 < len(rest) else ""
        elif token.startswith(("--training-loop=", "training-loop=", "training_loop=")):
            value = token.split("=", 1)[1]
    if value is None and path and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as handle:
                mapping = yaml.safe_load(handle)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            mapping = None  # load_config reports it with the rest of the file
        if isinstance(mapping, dict):
            sections = [v for k, v in mapping.items() if _canonical(k) in SECTION_PREFIXES and isinstance(v, dict)]
            value = next((v for table in (mapping, *sections) for k, v in table.items()
                          if _canonical(k) == "training-loop"), None)
    value = "auto" if value is None else str(value)
    if value not in TRAINING_LOOPS:
        raise ConfigError(f"--training-loop {value!r}: choose one of {', '.join(TRAINING_LOOPS)}")
    return value
