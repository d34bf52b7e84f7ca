"""The README's families x heads table, from `nprf_hf/families.py` (the one place that spells them):
one row per family, one column per head.

    python utils/readme_families.py        # prints the table; the README's Install section holds it

tests/test_readme_figure.py checks that the README's table (the one whose header starts with `| family |`) is this
output, and that the README names every source class that converts to another head, so neither can go stale.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the clone's nprf_hf

from nprf_hf.families import FAMILIES, HEADS  # noqa: E402  (no torch import)


def families_table():
    """Markdown: one row per family, one column per head (its `--head` / `head=` name), ✓ where the family has it."""
    lines = ["| family | " + " | ".join(f"`{head}`" for head in HEADS) + " |", "|---|" + "---|" * len(HEADS)]
    for family in FAMILIES.values():
        lines.append(f"| {family.display_name} | " + " | ".join("✓" if h in family.heads else "" for h in HEADS) + " |")
    return "\n".join(lines)


def alias_notes():
    """What the README says of each source class that converts to another head: "`BertForPreTraining` converts to
    `masked-lm`"."""
    return [f"`{f.prefix}{suffix}` converts to `{head}`" for f in FAMILIES.values() for suffix, head in f.source_aliases]


if __name__ == "__main__":
    print(families_table())
    print("; ".join(alias_notes()))
