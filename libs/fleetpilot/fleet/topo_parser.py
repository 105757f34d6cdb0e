"""Parse the text of ``nvidia-smi topo -m`` into a ``TopoMatrix``.

Handles the variants seen in the field: tab- or space-separated cells, ANSI underline
codes around the header, NIC rows and columns (``NIC0`` with a ``NIC Legend`` mapping it
to ``mlx5_0``, or older drivers that print ``mlx5_0`` directly), the trailing ``CPU
Affinity`` / ``NUMA Affinity`` / ``GPU NUMA ID`` columns in any subset, the obsolete
``SOC`` cell (read as ``SYS``), and the legend text after the matrix.

Anything that is not a matrix raises ``TopoParseError`` (a ``ValueError``) naming the
1-based line number, so an operator can see which line of a pasted report is wrong.
"""

from __future__ import annotations

import re

import msgspec

# Trailing columns after the device columns, longest first so "GPU NUMA ID" wins over
# a device called "GPU..." when the header is tokenised.
_TRAILING_COLUMNS: tuple[tuple[str, ...], ...] = (
    ("CPU", "Affinity"),
    ("NUMA", "Affinity"),
    ("GPU", "NUMA", "ID"),
)
_CELL = re.compile(r"^(X|SYS|SOC|NODE|PHB|PXB|PIX|PSB|NV\d+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_NUMA_SET = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class TopoParseError(ValueError):
    """The text is not a ``nvidia-smi topo -m`` matrix; ``line`` is 1-based."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line


class TopoMatrix(msgspec.Struct, frozen=True, kw_only=True):
    """The matrix as printed: device names, cells, affinity columns and the NIC legend.

    ``cells[i][j]`` is the printed link kind between ``devices[i]`` and ``devices[j]``
    (``"X"`` on the diagonal, ``"NV12"`` for twelve bonded NVLinks, ``SOC`` already read
    as ``SYS``). Affinity maps are keyed by device name; the NUMA ones hold ``None`` for
    ``N/A`` and for a set of several NUMA nodes (``0-1``), where no single node applies; a
    CPU affinity of ``N/A`` is left out.
    """

    devices: list[str]
    cells: list[list[str]]
    cpu_affinity: dict[str, str] = msgspec.field(default_factory=dict)
    numa_affinity: dict[str, int | None] = msgspec.field(default_factory=dict)
    gpu_numa_id: dict[str, int | None] = msgspec.field(default_factory=dict)
    nic_names: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def gpus(self) -> list[str]:
        """The GPU device names in column order (``GPU0``, ``GPU1`` ...)."""
        return [d for d in self.devices if d.startswith("GPU")]

    @property
    def nics(self) -> list[str]:
        """The non-GPU device names in column order (``NIC0`` or ``mlx5_0`` ...)."""
        return [d for d in self.devices if not d.startswith("GPU")]

    def cell(self, a: str, b: str) -> str:
        """The printed link kind between two devices."""
        return self.cells[self.devices.index(a)][self.devices.index(b)]


def _split_header(tokens: list[str]) -> tuple[list[str], list[str]]:
    devices: list[str] = []
    trailing: list[str] = []
    i = 0
    while i < len(tokens):
        for words in _TRAILING_COLUMNS:
            if tuple(tokens[i:i + len(words)]) == words:
                trailing.append(" ".join(words))
                i += len(words)
                break
        else:
            if trailing:
                # A device after the affinity columns means the header is not one we know.
                raise ValueError(f"unexpected header word {tokens[i]!r} after the affinity columns")
            devices.append(tokens[i])
            i += 1
    return devices, trailing


def _optional_int(text: str) -> int | None:
    if text.upper() in {"N/A", "NA", "-"}:
        return None
    if text.isdigit():
        return int(text)
    if _NUMA_SET.match(text):
        # Servers whose GPU hangs off several NUMA nodes print the set ("0-1", "0,2"): the
        # GPU has no single NUMA node, which is what ``None`` says downstream.
        return None
    return int(text)  # ValueError for anything else: the caller names the line


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse ``nvidia-smi topo -m`` output; raise ``TopoParseError`` on anything else."""
    lines = [_ANSI.sub("", raw).rstrip() for raw in text.splitlines()]
    header_at = next((n for n, line in enumerate(lines) if line.strip()), None)
    if header_at is None:
        raise TopoParseError(1, "empty input")
    header_tokens = lines[header_at].split()
    try:
        devices, trailing = _split_header(header_tokens)
    except ValueError as exc:
        raise TopoParseError(header_at + 1, str(exc)) from None
    if not devices or not devices[0].startswith("GPU"):
        raise TopoParseError(header_at + 1, f"expected a header starting with GPU0, got {lines[header_at].strip()[:40]!r}")

    cells: dict[str, list[str]] = {}
    cpu_affinity: dict[str, str] = {}
    numa_affinity: dict[str, int | None] = {}
    gpu_numa_id: dict[str, int | None] = {}
    n = len(devices)
    row_at = header_at + 1
    while row_at < len(lines) and lines[row_at].strip():
        line = lines[row_at]
        if line.strip().startswith("Legend"):
            break
        tokens = line.split()
        name = tokens[0]
        if name not in devices:
            raise TopoParseError(row_at + 1, f"row device {name!r} is not a column of the header")
        if name in cells:
            raise TopoParseError(row_at + 1, f"row {name!r} appears twice")
        row = ["SYS" if tok == "SOC" else tok for tok in tokens[1:1 + n]]
        if len(row) < n:
            raise TopoParseError(row_at + 1, f"row {name!r} has {len(row)} cells, expected {n}")
        for tok in row:
            if not _CELL.match(tok):
                raise TopoParseError(row_at + 1, f"unknown link kind {tok!r} in row {name!r}")
        cells[name] = row
        extra = tokens[1 + n:]
        # NIC rows carry no affinity columns; GPU rows carry one value per trailing column.
        if extra:
            if len(extra) > len(trailing):
                raise TopoParseError(row_at + 1, f"row {name!r} has {len(extra)} values for {len(trailing)} affinity columns")
            try:
                for column, value in zip(trailing, extra, strict=False):
                    if column == "CPU Affinity":
                        # "N/A" (a VM, a GPU with no CPU affinity) is no CPU list: left out,
                        # as NVML's unknown affinity is, rather than passed on as one.
                        if value.upper() not in {"N/A", "NA", "-"}:
                            cpu_affinity[name] = value
                    elif column == "NUMA Affinity":
                        numa_affinity[name] = _optional_int(value)
                    else:
                        gpu_numa_id[name] = _optional_int(value)
            except ValueError:
                raise TopoParseError(row_at + 1, f"bad affinity value in row {name!r}: {extra!r}") from None
        row_at += 1

    missing = [d for d in devices if d not in cells]
    if missing:
        raise TopoParseError(row_at + 1, f"no row for {', '.join(missing)}")
    for i, dev in enumerate(devices):
        if cells[dev][i] != "X":
            raise TopoParseError(header_at + 2 + i, f"diagonal of {dev!r} is {cells[dev][i]!r}, expected 'X'")

    nic_names: dict[str, str] = {}
    for line in lines[row_at:]:
        match = _NIC_LEGEND.match(line)
        if match:
            nic_names[match.group(1)] = match.group(2)
    return TopoMatrix(
        devices=devices,
        cells=[cells[d] for d in devices],
        cpu_affinity=cpu_affinity,
        numa_affinity=numa_affinity,
        gpu_numa_id=gpu_numa_id,
        nic_names=nic_names,
    )
