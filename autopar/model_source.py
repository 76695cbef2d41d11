"""Resolve the CLI's MODEL argument into ``(model, example_inputs)``.

Three spellings, all calling a factory ``name(**config) -> (model, example_inputs)``:

- ``path/to/file.py:factory``  a Python file and a function in it;
- ``package.module:factory``   an importable module and a function in it;
- ``gpt2-124m``                a preset of ``autopar_examples.models`` (``autopar devices``' sibling
                               for models: ``autopar_examples.models.PRESETS``).

``--config key=value`` pairs become keyword arguments, their values read as YAML scalars
(``n_layer=2`` is an int, ``dropout=0.1`` a float, ``bias=false`` a bool).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import io
import sys
import tokenize
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from autopar_plans.errors import UsageError
from autopar_plans.files import MODEL_FILE, decode_text, read_bytes

Factory = Callable[..., tuple[nn.Module, tuple[Any, ...]]]


def parse_config(pairs: Sequence[str]) -> dict[str, Any]:
    """``["n_layer=2", "dropout=0.1"]`` -> ``{"n_layer": 2, "dropout": 0.1}``."""
    config: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UsageError(f"--config {pair!r}: write key=value, such as n_layer=2")
        try:
            config[key.strip()] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            config[key.strip()] = text
    return config


def resolve_factory(spec: str) -> tuple[Factory, str]:
    """The factory a MODEL string names, and a display name for it."""
    target, sep, attr = spec.rpartition(":")
    if not sep:
        return _preset_factory(spec), spec
    if not target or not attr:
        raise UsageError(f"MODEL {spec!r}: write path/to/file.py:factory or package.module:factory")
    if target.endswith(".py") or "/" in target or Path(target).suffix == ".py":
        module = _load_file(Path(target), spec)
    else:
        try:
            module = importlib.import_module(target)
        except (Exception, SystemExit) as error:  # not found, a relative name, or its code
            raise UsageError(f"MODEL {spec!r}: cannot import module {target!r}: {error}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UsageError(f"MODEL {spec!r}: {target} has no function {attr!r}{hint}")
    return factory, f"{Path(target).stem if target.endswith('.py') else target}:{attr}"


def build_model(
    spec: str, config: dict[str, Any] | None = None, *, meta: bool = False
) -> tuple[nn.Module, tuple[Any, ...], str]:
    """Call the factory a MODEL string names; ``meta=True`` asks for ``device="meta"``.

    The meta request is passed only when the factory takes a ``device`` argument (or
    ``**kwargs``) and the user did not set one.
    """
    factory, name = resolve_factory(spec)
    config = dict(config or {})
    if meta and "device" not in config and _accepts(factory, "device"):
        config["device"] = "meta"
    try:
        result = factory(**config)
    except TypeError as error:
        raise UsageError(f"MODEL {spec!r}: {error}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise UsageError(
            f"MODEL {spec!r}: the factory must return (model, example_inputs), "
            f"got {type(result).__name__}"
        )
    model, inputs = result
    inputs = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    return model, inputs, name


def _accepts(factory: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _preset_factory(name: str) -> Factory:
    from autopar_examples.models import PRESETS, build

    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=3)
        hint = f" did you mean {', '.join(close)}?" if close else ""
        raise UsageError(
            f"MODEL {name!r} is neither path/to/file.py:factory, package.module:factory, "
            f"nor a preset ({', '.join(sorted(PRESETS))});{hint}"
        )

    def factory(**config: Any) -> tuple[nn.Module, tuple[Any, ...]]:
        return build(name, **config)

    return factory


def _load_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise UsageError(f"MODEL {spec!r}: no such file {path}")
    _check_source(path, spec)
    module_name = f"autopar_user_model_{abs(hash(path.resolve()))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UsageError(f"MODEL {spec!r}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # the user's code: anything may be raised
        del sys.modules[module_name]
        raise UsageError(
            f"MODEL {spec!r}: importing {path} failed: {type(error).__name__}: {error}"
        ) from None
    return module


def _check_source(path: Path, spec: str) -> None:
    """Refuse a model file too large to be source, or not text in its declared encoding
    (UTF-8 unless a ``# coding:`` line says otherwise), before Python compiles it: a
    checkpoint passed by mistake gets a message, not a decoding traceback or minutes of
    compiling."""
    try:
        data = read_bytes(path, MODEL_FILE)
        decode_text(data, str(path), MODEL_FILE, _source_encoding(data, path))
    except UsageError as error:
        raise UsageError(f"MODEL {spec!r}: {error}") from None


def _source_encoding(data: bytes, path: Path) -> str:
    """The encoding Python will read ``data`` in (PEP 263), a BOM being UTF-8's."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as error:
        decode_text(data, str(path), MODEL_FILE)  # names the first bad byte, if that is it
        raise UsageError(f"{path}: {error.msg}; {MODEL_FILE.expected}") from None
    return "utf-8" if encoding == "utf-8-sig" else encoding
