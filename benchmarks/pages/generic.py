"""The results page's section for a result no module in ``benchmarks.pages`` renders (a new benchmark, or
a known one whose layout changed): its scalars, its checks and every list of records as a table."""

from __future__ import annotations

from .common import (
    CHECK_KEYS,
    DASH,
    META_KEYS,
    Rendered,
    Result,
    by_key,
    cell,
    flatten,
    keyed_records,
    list_of_records,
    table,
)


def render_generic(result: Result) -> Rendered:
    """Any result, whatever its structure: top-level scalars (and nested dicts of scalars) as one table,
    every list of records as its own table. Settings, checks and provenance are added by the caller."""
    data = result.data
    skip = set(META_KEYS) | set(CHECK_KEYS) | {"settings"}
    scalars = []
    record_lists = []
    for key, value in data.items():
        if key in skip:
            continue
        if list_of_records(value):
            record_lists.append((key, value))
        elif keyed_records(value):
            # Leaves flattened per record, so nested fields ("extra.executor.workers") become columns.
            record_lists.append((key, [{"": name, **dict(flatten(sub))} for name, sub in value.items()]))
        elif isinstance(value, dict):
            for sub, leaf in flatten(value, key):
                if list_of_records(leaf):
                    record_lists.append((sub, leaf))
                else:
                    scalars.append((sub, leaf))
        else:
            scalars.append((key, value))
    body: list[str] = []
    if scalars:
        body += table(["field", "value"], [[cell(k), by_key(k, v, 300)] for k, v in scalars])
    # "rows" is the conventional main table of a result: show it first, the others in file order.
    record_lists.sort(key=lambda item: item[0] != "rows")
    for key, records in record_lists:
        columns: list[str] = []
        for record in records:
            columns += [c for c in record if c not in columns]
        body += ["", f"`{key}` ({len(records)} rows):", ""]
        body += table(
            [str(c) for c in columns],
            [[by_key(str(c), r[c]) if c in r else DASH for c in columns] for r in records],
        )
    headline = data.get("headline")
    return Rendered(
        title=result.name,
        headline=headline if isinstance(headline, str) and headline else "see section",
        body=body or ["(no numbers in this result)"],
    )
