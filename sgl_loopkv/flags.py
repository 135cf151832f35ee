"""How a settings field becomes a ``--loopkv-*`` flag: its argparse type, metavar, default text and help.

A field declares only what cannot be derived (``help`` always; ``choices`` or ``registry``; ``metavar``
for paths; ``default_text`` when the default is computed at start-up); its type follows from the
annotation (:data:`FIELD_TYPES`: ``Bytes`` for byte quotas, which take units), its default text from
the default. :meth:`Option.problems` says what a field lacks; ``tests/unit/test_config.py`` requires
none for every flag, so a new flag without help or a displayable default fails there.

Byte sizes (:func:`parse_bytes`) follow SI and IEC: ``KB``/``MB``/``GB``/``TB`` (and ``K``/``M``/``G``/
``T``) are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` (and ``Ki``...) powers of 1024, case-insensitive.
"""

from __future__ import annotations

import argparse
import functools
import pkgutil
import re
from dataclasses import MISSING, Field, dataclass
from decimal import Decimal
from typing import Any

from sgl_loopkv.extensions import load_extensions

#: A byte count; as a field annotation it makes the flag accept units (``2GiB``, ``500MB``).
Bytes = int

UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    UNITS |= {_p: 1000**_i, _p + "b": 1000**_i, _p + "i": 1024**_i, _p + "ib": 1024**_i}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.I)
BYTES_HELP = (
    "BYTES: an integer or a number with a unit: KB, MB, GB, TB (or K, M, G, T) are powers of 1000, "
    "KiB, MiB, GiB, TiB powers of 1024 (2GiB, 500MB, 1.5G)."
)


def parse_bytes(text: str) -> int:
    """``"2GiB"`` -> 2147483648, ``"1.5G"`` -> 1500000000, ``"123"`` -> 123 (a fraction of a byte is
    dropped). Raises ``argparse.ArgumentTypeError`` (argparse prints it after the flag's name)."""
    try:
        n = int(text)
    except ValueError:
        m = _SIZE.fullmatch(text)
        unit = UNITS.get(m[2].lower()) if m else None
        if unit is None:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a byte size: use an integer or a number with a unit, e.g. 2GiB, 500MB, 1.5G"
            ) from None
        n = int(Decimal(m[1]) * unit)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a byte size must be >= 0")
    return n


def format_bytes(n: int) -> str:
    """The largest IEC unit that divides ``n`` exactly (``2147483648`` -> ``"2GiB"``), else plain bytes."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n and n % 1024**power == 0:
            return f"{n // 1024**power}{unit}"
    return str(n)


#: annotation (as written: this package uses postponed annotations) -> argparse type and type name
FIELD_TYPES: dict[str, tuple[Any, str]] = {
    "int": (int, "int"),
    "float": (float, "float"),
    "str": (str, "str"),
    "str | None": (str, "str"),
    "Bytes": (parse_bytes, "bytes"),
    "bool": (None, "switch"),  # store_true
}


@dataclass(frozen=True, slots=True)
class Option:
    """One flag: ``section`` (None = a top-level field) and the dataclass field behind it."""

    section: str | None
    field: Field
    prefix: str = ""

    @property
    def name(self) -> str:
        """The flag without ``--loopkv-``, snake_case (``restore_planner``); also the argparse dest suffix."""
        return self.prefix + self.field.name

    @property
    def flag(self) -> str:
        return "--loopkv-" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return "loopkv_" + self.name

    @property
    def meta(self) -> Any:
        return self.field.metadata

    @property
    def baseline(self) -> bool:
        """Only benchmarks use it (a baseline or an ablation): listed apart in ``--help`` and the docs."""
        return bool(self.meta.get("baseline"))

    def registry(self) -> Any:
        """The registry this flag picks from (None: literal ``choices`` or none), looked up now."""
        return pkgutil.resolve_name(self.meta["registry"]) if "registry" in self.meta else None

    def choices(self) -> list[str] | None:
        """The registry's names (plus the ``off`` value first), or the literal ``choices``."""
        if "registry" in self.meta:
            load_extensions()  # names registered from outside the package (a benchmark's baseline)
            return ([self.meta["off"]] if "off" in self.meta else []) + self.registry().names()
        return self.meta.get("choices")

    @property
    def switch(self) -> bool:
        return self.meta.get("action", "store_true" if self.field.type == "bool" else None) == "store_true"

    def type_name(self) -> str | None:
        """``int``, ``float``, ``bytes``, ``str``, ``dir``/``file`` (``metavar``), ``choice`` or ``switch``."""
        if self.switch:
            return "switch"
        if self.choices() is not None:
            return "choice"
        if "metavar" in self.meta:
            return self.meta["metavar"].lower()
        return FIELD_TYPES.get(self.field.type, (None, None))[1]

    def default_text(self) -> str | None:
        """The default as ``--help`` and the docs show it; None when a field's default cannot be shown."""
        if "default_text" in self.meta:
            return self.meta["default_text"]
        value = self.field.default
        if value is MISSING or value is None:
            return None
        if self.switch:
            return "on" if value else "off"
        return format_bytes(value) if self.field.type == "Bytes" else str(value)

    def help_text(self) -> str:
        """The help string with its default appended (``%`` escaped for argparse)."""
        return f"{self.meta['help']} (default: {self.default_text()})".replace("%", "%%")

    def argparse_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"default": self.field.default, "help": self.help_text(), "dest": self.dest}
        if self.switch:
            kwargs["action"] = "store_true"
            return kwargs
        kwargs["type"] = self.meta.get("type") or FIELD_TYPES.get(self.field.type, (None, None))[0]  # None: str
        choices = self.choices()
        registry = self.registry()
        if registry is not None and registry.hint and kwargs["type"] is str:  # unknown: the registry's error and hint
            kwargs["type"] = functools.partial(_registered, registry, choices)
        if choices is not None:
            kwargs["choices"] = choices
        else:
            kwargs["metavar"] = self.meta.get("metavar") or (self.type_name() or "value").upper()
        return kwargs

    def problems(self) -> list[str]:
        """What keeps this flag from documenting itself (empty when nothing does)."""
        out = []
        help_ = self.meta.get("help", "")
        if not help_.strip() or not help_.rstrip().endswith((".", ")")):
            out.append("needs a 'help' of one or two sentences, ending with a full stop")
        if self.default_text() is None:
            out.append("needs a 'default_text' (its default cannot be shown)")
        if self.type_name() is None:
            out.append(f"has an annotation {self.field.type!r} without a flag type (see FIELD_TYPES)")
        if self.name.endswith("_bytes") and self.field.type != "Bytes":
            out.append("is a byte quota: annotate it 'Bytes' so it takes units")
        if self.switch and self.field.default is not False:
            out.append("is a switch: its default must be False")
        return [f"{self.flag} {p}" for p in out]


def _registered(registry, choices: list[str], value: str) -> str:
    """A registry flag's value: a registered name (or the ``off`` value), else argparse's error in the
    registry's words (naming where a name registered from outside the package comes from)."""
    if value not in choices:
        raise argparse.ArgumentTypeError(registry.unknown(value))
    return value
