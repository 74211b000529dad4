"""``gateway keys add|revoke``: manage the known-keys file without ever storing a key."""

from __future__ import annotations

import argparse
import sys

ADD_EPILOG = """\
The key is printed once, on the first line of the output, and never stored: the file
keeps only its SHA-256. A running gateway picks the change up by itself.

Example:
  gateway keys add --file keys.yaml --consumer acme --tier gold
"""

REVOKE_EPILOG = """\
Examples:
  gateway keys revoke --file keys.yaml --consumer acme      # every key of acme
  gateway keys revoke --file keys.yaml --hash 3f9a0c1d      # one key, by its SHA-256
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``keys`` and its ``add`` and ``revoke`` subcommands."""
    keys = subparsers.add_parser(
        "keys", help="add or revoke known API keys (identity.api_key.keys)"
    )
    commands = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")

    add = commands.add_parser(
        "add",
        help="make a new random key for a consumer and list its hash",
        description="Make a strong random API key for a consumer, append its SHA-256 to the "
        "key file (created with mode 0600 if absent) and print the key once.",
        epilog=ADD_EPILOG,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    add.add_argument("--file", required=True, metavar="PATH", help="the key file")
    add.add_argument("--consumer", required=True, metavar="NAME", help="who the key is for")
    add.add_argument(
        "--tier",
        metavar="NAME",
        help="the consumer's tier (rules' tiers: limits); default: the consumer's current one",
    )
    add.set_defaults(func=_add)

    revoke = commands.add_parser(
        "revoke",
        help="remove a consumer's keys, or one key by a prefix of its hash",
        description="Remove keys from the key file; a running gateway stops accepting them "
        "at its next reload of the file.",
        epilog=REVOKE_EPILOG,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    revoke.add_argument("--file", required=True, metavar="PATH", help="the key file")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--consumer", metavar="NAME", help="remove every key of this consumer")
    which.add_argument(
        "--hash",
        dest="hash_prefix",
        metavar="PREFIX",
        help="remove the one key whose SHA-256 starts with PREFIX (8+ hex digits)",
    )
    revoke.set_defaults(func=_revoke)

    def usage(_args: argparse.Namespace) -> int:
        keys.print_help()
        return 2

    keys.set_defaults(func=usage)


def _add(args: argparse.Namespace) -> int:
    from gateway.identity.key_edit import SHOWN_HASH_DIGITS, add_key, key_digest

    try:
        key = add_key(args.file, args.consumer, args.tier)
    except (ValueError, OSError) as exc:
        print(f"gateway keys add: {exc}", file=sys.stderr)
        return 1
    print(key)
    print("This key is shown only now and cannot be shown again: the file keeps only its hash.")
    print(f"consumer {args.consumer}, sha256 {key_digest(key)[:SHOWN_HASH_DIGITS]}, in {args.file}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from gateway.identity.key_edit import revoke

    try:
        count = revoke(args.file, consumer=args.consumer, hash_prefix=args.hash_prefix)
    except (ValueError, OSError) as exc:
        print(f"gateway keys revoke: {exc}", file=sys.stderr)
        return 1
    if count == 0:
        print(f"gateway keys revoke: consumer {args.consumer!r} has no key in {args.file}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"revoked {count} key(s) from {args.file}")
    return 0
