"""``batchserve traffic``: read, set or clear a model's traffic split through a running
server's admin API (``GET``/``PUT /admin/models/{name}/traffic``; clearing puts the version
with the most weight at 100).

It prints the server's answer as JSON. Exit status: 0 when the server did it, 1 when it
refused (its message on stderr), 2 when the weights given cannot be read or the server
cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import sys

import orjson

from service.server.admin_client import AdminApi, AdminError
from service.traffic_split import primary_of

EXIT_REFUSED = 1
EXIT_UNUSABLE = 2
#: Splitting loads versions on every engine first: a switch's time, not a request's.
TIMEOUT_S = 300.0


def add_traffic_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    traffic = commands.add_parser(
        "traffic",
        help="read, set or clear a model's traffic split over its versions (admin API)",
        description="Through a running server's admin API: --set v1=95,v2=5 loads every "
        "version named on every engine (verified and warmed up) and splits the model's "
        "requests by those weights (whole percents summing to 100; sticky by each request's "
        "x-routing-key header); --show prints the weights and each version's requests, "
        "errors and p50/p99 latency over the recent window; --clear serves the version with "
        "the most weight alone. Exit status: 0 done, 1 refused by the server (its message on "
        "stderr), 2 unreadable weights or no server.",
    )
    traffic.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    traffic.add_argument(
        "--token",
        default=None,
        help="the admin bearer token (default: BATCHSERVE_ADMIN_TOKEN from the environment)",
    )
    traffic.add_argument("--model", required=True, help="the model's name")
    action = traffic.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--set", dest="weights", metavar="V=W,...", help="weights by version id, e.g. v1=95,v2=5"
    )
    action.add_argument("--show", action="store_true", help="print the split and its figures")
    action.add_argument("--clear", action="store_true", help="serve the primary version alone")


def parse_weights(text: str) -> dict[str, int]:
    """``v1=95,v2=5`` as ``{"v1": 95, "v2": 5}``; ``ValueError`` quoting a malformed pair
    (the server checks the range and the sum)."""
    weights: dict[str, int] = {}
    for pair in text.split(","):
        version, equals, weight = pair.strip().partition("=")
        if not equals or not version.strip() or not weight.strip().lstrip("-").isdigit():
            raise ValueError(f"weights are version=percent pairs separated by commas, got {pair!r}")
        if version.strip() in weights:
            raise ValueError(f"version {version.strip()!r} is given twice")
        weights[version.strip()] = int(weight)
    return weights


def run_traffic(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("BATCHSERVE_ADMIN_TOKEN", "")
    api = AdminApi(args.url, token, timeout_s=TIMEOUT_S)
    path = f"/admin/models/{args.model}/traffic"
    try:
        if args.weights is not None:
            answer = api.call("PUT", path, {"weights": parse_weights(args.weights)})
        else:
            answer = api.call("GET", path)
            if args.clear:
                primary = primary_of(answer["weights"])
                answer = api.call("PUT", path, {"weights": {primary: 100}})
    except ValueError as error:
        print(f"batchserve traffic: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    except AdminError as error:
        print(f"batchserve traffic: {error}", file=sys.stderr)
        return EXIT_UNUSABLE if error.status == 0 else EXIT_REFUSED
    sys.stdout.write(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0
