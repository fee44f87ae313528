"""``declattn show``: a PNG and a web page of one DA response, from its run record."""

from __future__ import annotations

import argparse
from typing import Any

from declattn.cli.common import UserError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "show",
        help="draw a run record: mode timeline, attended tokens, chunks read",
        description="Write RECORD's stem as .png (mode per decode step, attended tokens "
        "against vanilla, the chunks each step read) and .html (the response coloured by "
        "mode beside the chunks it read, and what each focus resolved to). The page embeds the "
        "picture. Prints both paths, then a one-line focus summary. The saving shown is per "
        "step (against the same reply read in full); --plain adds the cost per answer "
        "(against the plain reply to the same question).",
    )
    p.add_argument("record", help="a run record JSON file (from `declattn run --save`)")
    p.add_argument("--out", help="folder for the files (default: next to the record)")
    p.add_argument("--plain", metavar="RECORD",
                   help="the plain answer's record to the same question (run --compare "
                   "--save writes NAME.vanilla.json): adds DA's cost per answer against it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from declattn.show import write_show

    try:
        files = write_show(args.record, args.out, args.plain)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from e
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        raise UserError(f"cannot write to {args.out or 'the record folder'}: {e}") from e
    print(files.png)
    print(files.html)
    print(files.focus)
    if files.per_answer is not None:
        print(files.per_answer)
    return 0
