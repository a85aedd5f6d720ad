"""The engine_throughput table (one per dtype): one column per server, ratios against ours, and the
targets (issue 20: at least 1.25x vLLM's output tokens/s at 1, 8 and 32 streams in each dtype, and
a cold 2K-token TTFT no worse than vLLM's)."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

TARGET_VS_VLLM = 1.25  # ours' output tokens/s at each of TARGET_STREAMS, at least this times vLLM's
TARGET_VS_HF = 2.0  # ... and at least this times transformers serve's
TARGET_COLD_TTFT_VS_VLLM = 1.0  # ours' cold 2K-token TTFT at most this times vLLM's
TARGET_CACHED_OVER_COLD = 0.2  # cached TTFT at most 1/5 of cold
TARGET_STREAMS = (1, 8, 32)


def _median_fields(items: list[dict]) -> dict:
    """Per numeric field, the median over `items` (missing values skipped); others from the first."""
    out = dict(items[0])
    for key in items[0]:
        vals = [it.get(key) for it in items]
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not nums or len(nums) < len([v for v in vals if v is not None]):
            continue
        med = statistics.median(nums)
        out[key] = int(med) if all(isinstance(v, int) for v in nums) and med == int(med) else round(med, 4)
    return out


def merge_rounds(entries: list[dict]) -> dict:
    """One server's rounds -> one entry whose phase and prefix numbers are per-metric medians."""
    ok = [e for e in entries if "error" not in e and "skipped" not in e]
    if len(entries) == 1 or not ok:
        return entries[0]
    merged = {k: v for k, v in ok[0].items() if k not in ("phases", "prefix")}
    levels = [p["concurrency"] for p in ok[0].get("phases") or []]
    merged["phases"] = [
        _median_fields([p for e in ok for p in e["phases"] if p["concurrency"] == c]) for c in levels
    ]
    prefixes = [e["prefix"] for e in ok if e.get("prefix")]
    if prefixes:
        pm = _median_fields(prefixes)
        cold, cached = pm.get("cold_ttft_ms_median"), pm.get("cached_ttft_ms_median")
        pm["cached_over_cold"] = round(cached / cold, 4) if cold and cached else None
        merged["prefix"] = pm
    merged["rounds"] = entries
    merged["failed_rounds"] = len(entries) - len(ok)
    return merged


def _phase(entry: dict, c: int) -> dict | None:
    for p in entry.get("phases") or []:
        if p["concurrency"] == c:
            return p
    return None


def _metric(result: dict, name: str, key: str, c: int | None = None) -> float | None:
    entry = result["backends"].get(name) or {}
    if c is None:
        return (entry.get("prefix") or {}).get(key)
    p = _phase(entry, c)
    return None if p is None else p.get(key)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def print_report(result: dict, console: Console | None = None) -> dict:
    """Print the table and the target checks; return them as a summary dict for the JSON."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and pipes: wide enough that rows do not wrap
            console = Console(width=140)
    names = list(result["backends"])  # ours, vllm, hf, and any extra backend a caller added
    levels = sorted({p["concurrency"] for n in names for p in result["backends"][n].get("phases") or []})
    rows: list[tuple[str, str, int | None, bool]] = []  # (label, key, concurrency, higher is better)
    for c in levels:
        rows += [
            (f"output tok/s @{c}", "output_tokens_per_s", c, True),
            (f"TTFT p50 ms @{c}", "ttft_p50_ms", c, False),
            (f"TTFT p99 ms @{c}", "ttft_p99_ms", c, False),
            (f"ITL mean ms @{c}", "itl_mean_ms", c, False),
        ]
    rows += [
        ("2k TTFT cold ms", "cold_ttft_ms_median", None, False),
        ("2k TTFT cached ms", "cached_ttft_ms_median", None, False),
        ("cached / cold", "cached_over_cold", None, False),
    ]
    dtype = result.get("dtype", "float32")
    cpu = (result.get("machine") or {}).get("cpu_model", "?")
    table = Table(title=f"engine_throughput on {result['model']} {dtype}, {cpu} "
                        f"({result['settings']['threads']} thread(s), KV {result['settings']['kv_cache_gib']} GiB, "
                        f"load at start {result['load_average_at_start'][0]})")
    table.add_column("metric", no_wrap=True)
    for n in names:
        table.add_column(result["backends"][n].get("label", n), justify="right")
    if "ours" in names:
        for other in ("vllm", "hf"):
            if other in names:
                table.add_column(f"ours/{other}", justify="right")
    ratios: dict[str, dict[str, float | None]] = {}
    for label, key, c, _ in rows:
        vals = {n: _metric(result, n, key, c) for n in names}
        digits = 3 if key == "cached_over_cold" else 1
        cells = [_fmt(vals[n], digits) for n in names]
        if "ours" in names:
            for other in ("vllm", "hf"):
                if other in names:
                    r = _ratio(vals["ours"], vals[other])
                    ratios.setdefault(label, {})[f"ours/{other}"] = r
                    cells.append(_fmt(r, 2) + "x" if r is not None else "-")
        table.add_row(label, *cells)
    console.print(table)
    for name in names:
        entry = result["backends"][name]
        if "error" in entry or "skipped" in entry:
            console.print(f"[yellow]{name}: {entry.get('error') or entry['skipped']}")

    checks = []
    if "ours" in names:
        for c in TARGET_STREAMS:
            ours = _metric(result, "ours", "output_tokens_per_s", c)
            for other, target in (("vllm", TARGET_VS_VLLM), ("hf", TARGET_VS_HF)):
                r = _ratio(ours, _metric(result, other, "output_tokens_per_s", c)) if other in names else None
                if r is not None:
                    checks.append({"target": f"tok/s @{c} ours/{other} >= {target}", "value": r, "met": r >= target})
        if "vllm" in names:
            r = _ratio(_metric(result, "ours", "cold_ttft_ms_median"), _metric(result, "vllm", "cold_ttft_ms_median"))
            if r is not None:
                checks.append({"target": f"2k cold TTFT ours/vllm <= {TARGET_COLD_TTFT_VS_VLLM}", "value": r,
                               "met": r <= TARGET_COLD_TTFT_VS_VLLM})
        coc = _metric(result, "ours", "cached_over_cold")
        if coc is not None:
            checks.append({"target": f"ours cached/cold TTFT <= {TARGET_CACHED_OVER_COLD}", "value": coc,
                           "met": coc <= TARGET_CACHED_OVER_COLD})
    for chk in checks:
        mark = "[green]met[/green]" if chk["met"] else "[red]MISSED[/red]"
        console.print(f"  {dtype}: {chk['target']}: {chk['value']}  {mark}")
    return {"ratios": ratios, "targets": checks}
