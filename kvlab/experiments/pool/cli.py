"""`kvlab pool create NAME --bytes N [--device cuda:N]` holds a pool (host memory, or chunks on that GPU) in the
foreground until Ctrl-C or SIGTERM (with --exit-when-idle, also once every other engine that joined has left);
`kvlab pool status NAME` prints the books; `kvlab pool limit NAME ENGINE --min B --max B` changes an engine's floor
and ceiling while it runs."""
from __future__ import annotations

import argparse
import json
import signal
import threading
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.machine import check_fits_in_ram, fmt_bytes
from kvlab.experiments.cli import flags as cli
from kvlab.experiments.pool.guard import readable_books
from kvlab.vmm import pool
from kvlab.vmm.pool.engines import EngineRecord

HOLDER = "pool-holder"          # the engine name of `kvlab pool create`'s own process (it takes no pages)
POLL_S = 0.2


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("pool", help="a machine-wide KV page pool shared by engines (create, status, limit)",
                              description=__doc__)
    actions = p.add_subparsers(dest="pool_action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a pool and hold it in the foreground")
    create.add_argument("name")
    create.add_argument("--bytes", type=cli.parse_bytes, required=True, help="the pool's total, e.g. 8GiB")
    create.add_argument("--page-size", type=cli.parse_bytes, default=pool.DEFAULT_PAGE_SIZE,
                        help=f"bytes per page, fixed for the pool's life (default {fmt_bytes(pool.DEFAULT_PAGE_SIZE)})")
    create.add_argument("--device", default="cpu", type=cli.parse_device,
                        help="where the pages are: cpu (a memfd, default) or cuda[:N] (exportable chunks on that GPU; "
                             "--page-size is rounded up to the device's granularity)")
    create.add_argument("--exit-when-idle", action="store_true",
                        help="also end once other engines have joined and all of them have left")
    status = actions.add_parser("status", help="total, used, free and every engine's pages and limits")
    status.add_argument("name")
    status.add_argument("--json", action="store_true", help="print JSON instead of the table")
    limit = actions.add_parser("limit", help="change a running engine's floor (--min) and ceiling (--max)")
    limit.add_argument("name")
    limit.add_argument("engine", help="the engine's name or pid (see `kvlab pool status`)")
    limit.add_argument("--min", type=cli.parse_bytes, help="floor: bytes kept for the engine")
    limit.add_argument("--max", type=cli.parse_bytes, help="ceiling: the most bytes the engine may hold")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with readable_books(args.name if args.pool_action != "create" else None):
        return {"create": run_create, "status": run_status, "limit": run_limit}[args.pool_action](args)


def run_create(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        check_fits_in_ram(f"pool {args.name}", args.bytes, "lower --bytes")
        member, pages = pool.create(args.name, args.bytes, args.page_size, engine=HOLDER, ceiling=0), None
    else:
        from kvlab.vmm.drivers.pooled_cuda import create_cuda_pool
        member, pages = create_cuda_pool(args.name, args.bytes, args.page_size, args.device, HOLDER)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"pool {args.name}: {fmt_bytes(args.bytes)} in {member.total_pages} pages of "
              f"{fmt_bytes(member.page_size)} on {args.device}; engines join with --kv-pool {args.name} "
              f"(kv_pool={args.name!r}); Ctrl-C or SIGTERM ends it", flush=True)
        hold(member, stop, args.exit_when_idle)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pages is not None:
            pages.close([])
        member.close()
    print(f"pool {args.name}: closed", flush=True)
    return 0


def hold(member: pool.PoolMember, stop: threading.Event, exit_when_idle: bool) -> None:
    """Until `stop`, or (exit_when_idle) until others have joined and all have left."""
    while not stop.wait(POLL_S):
        if exit_when_idle:
            s = member.status()
            if s.joins > 1 and len(s.engines) == 1:
                return


def size(pages: int, page_size: int) -> str:
    return f"{fmt_bytes(pages * page_size)} ({pages})"


def engine_row(e: EngineRecord, page_size: int) -> str:
    return (f"{e.pid:>8}  {e.name:<20} {size(e.held, page_size):>18} {size(e.floor, page_size):>18} "
            f"{size(e.ceiling, page_size):>18} {e.given:>10} {e.taken:>10}")


def status_table(s: pool.PoolStatus) -> str:
    lines = [f"pool {s.name} on {s.device}: total {size(s.total, s.page_size)}, used {size(s.used, s.page_size)}, "
             f"free {size(s.free, s.page_size)}, kept for floors {size(s.reserved, s.page_size)}; "
             f"pages of {fmt_bytes(s.page_size)}; returned from dead engines: {s.reclaimed_pages} pages of "
             f"{s.reclaimed_engines} engines",
             f"{'pid':>8}  {'engine':<20} {'held (pages)':>18} {'floor':>18} {'ceiling':>18} {'given':>10} "
             f"{'taken':>10}"]
    return "\n".join(lines + [engine_row(e, s.page_size) for e in s.engines])


def run_status(args: argparse.Namespace) -> int:
    s = pool.status(args.name)
    print(json.dumps(s.to_json(), indent=2) if args.json else status_table(s))
    return 0


def run_limit(args: argparse.Namespace) -> int:
    if args.min is None and args.max is None:
        raise ConfigError("kvlab pool limit needs --min BYTES and/or --max BYTES")
    e = pool.set_limits(args.name, args.engine, args.min, args.max)
    page_size = pool.status(args.name).page_size
    print(f"pool {args.name}: engine {e.name} (pid {e.pid}) floor {size(e.floor, page_size)}, ceiling "
          f"{size(e.ceiling, page_size)}, holds {size(e.held, page_size)}")
    return 0
