#!/usr/bin/env python3
"""Read the callgrind profiles that scripts/profile-rtt writes and print
instructions per message, by layer, with the busy-poll spin taken out.

Usage: scripts/profile-callgrind.py [--functions MIN] DIR
(--functions MIN: also list, per process, every function that costs at
least MIN instructions per message.)
(DIR as scripts/profile-shm leaves it: one callgrind.out per process,
named CASE.RUN.PID, or per thread, CASE.RUN.PID-THREAD, where both ends
are threads of one process; and DIR/cases.json saying how many messages
each case moved.)

Method, per process:
  * Every instruction is put in the layer of the source file it came from
    (inlined code included: callgrind records the file of each line).
    Library code (std, libc, the vDSO) called from a layer counts for that
    layer; the benchmark's own loop (timing, statistics) is "harness" and
    left out of the totals.
  * Start-up, setup and teardown are taken out by difference: run a moves
    fewer messages than run b, everything else being equal.
  * A busy-polling side polls an empty queue many times per message, and
    how many times depends on scheduling (under valgrind even more). Run c
    is run a with --idle-us: the source pauses before each round trip, so
    the echo polls its empty queue far more often; the message work is the
    same. (c - a) / (its extra empty polls) is the cost of one empty poll,
    per layer, taken out of both processes of runs a and b: what remains
    is the work of the messages themselves. Empty polls are counted
    exactly (calls of the poll function less the messages).
"""

import functools
import json
import os
import re
import sys
from collections import defaultdict

FERRY_LIB = "/crates/ferry/src/"
FERRY_CLI = "/crates/ferry-cli/"

# Ferry's layers, by source file under crates/ferry/src.
LAYERS = [
    ("channel", "channel"),  # channel/ (channel.rs in older builds)
    ("domain.rs", "domain ledger"),
    ("ledger.rs", "domain ledger"),
    ("ring", "ring"),  # ring/ (ring.rs in older builds)
    ("proto.rs", "encode/decode"),
    ("backend/", "link"),
    ("buffer.rs", "buffer/pool"),
    ("pool.rs", "buffer/pool"),
    ("alloc.rs", "buffer/pool"),
    ("secure.rs", "page protection"),
    ("sys.rs", "syscalls"),
    ("inspect/", "counters"),
    ("wake.rs", "wake-ups"),
    ("error.rs", "errors/context"),
]
ORDER = [
    "channel",
    "domain ledger",
    "buffer/pool",
    "ring",
    "encode/decode",
    "link",
    "page protection",
    "counters",
    "wake-ups",
    "syscalls",
    "errors/context",
    "ferry (other)",
    "iceoryx2",
    "iceoryx2 (platform)",
    "libc/kernel calls",
    "harness",
    "other",
]


def layer_of_file(path):
    if path is None:
        return None
    i = path.find(FERRY_LIB)
    if i >= 0:
        rest = path[i + len(FERRY_LIB):]
        for prefix, layer in LAYERS:
            if rest.startswith(prefix):
                return layer
        return "ferry (other)"
    if FERRY_CLI in path or "/bench/peers/src/" in path:
        return "harness"
    if "/iceoryx2-bb-" in path or "/iceoryx2-pal-" in path or "/iceoryx2-cal-" in path:
        return "iceoryx2 (platform)"
    if "/iceoryx2-" in path:
        return "iceoryx2"
    return None


class Profile:
    """One callgrind.out file: self cost per (function, layer of the line),
    call edges with their inclusive cost, calls per function."""

    def __init__(self, path):
        self.path = path
        self.cmd = ""
        self.events = []
        self.fn_file = {}  # function -> file it is defined in (fl=)
        self.self_cost = defaultdict(lambda: defaultdict(int))  # fn -> layer-or-None -> Ir
        self.self_sys = defaultdict(int)  # fn -> syscalls
        self.edges = defaultdict(lambda: [0, 0, 0, None])  # (caller, callee) -> [calls, Ir, sys, callsite layer]
        self.calls_in = defaultdict(int)
        self.totals = None
        self._read()

    def _read(self):
        names = {"fl": {}, "fn": {}}
        fl = fi = fn = cfn = cfl = None
        pending_call = None
        with open(self.path, errors="replace") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line:
                    continue
                c = line[0]
                if c.isdigit() or c in "+-*":
                    parts = line.split()
                    costs = [int(x) for x in parts[1:]]
                    ir = costs[0] if costs else 0
                    sysc = costs[1] if len(costs) > 1 else 0
                    if pending_call is not None:
                        e = self.edges[(fn, cfn)]
                        e[0] += pending_call
                        e[1] += ir
                        e[2] += sysc
                        if e[3] is None:
                            e[3] = layer_of_file(fi or fl)
                        self.calls_in[cfn] += pending_call
                        pending_call = None
                    else:
                        self.self_cost[fn][layer_of_file(fi or fl)] += ir
                        self.self_sys[fn] += sysc
                    continue
                key, _, val = line.partition("=")
                if key in ("fl", "fi", "fe", "cfi", "cfl"):
                    name = self._name(names["fl"], val)
                    if key == "fl":
                        fl, fi = name, None
                    elif key in ("fi", "fe"):
                        fi = None if name == fl else name
                    else:
                        cfl = name
                elif key == "fn":
                    fn = self._name(names["fn"], val)
                    self.fn_file.setdefault(fn, fl)
                    fi = None
                elif key == "cfn":
                    cfn = self._name(names["fn"], val)
                    if cfl is not None:
                        self.fn_file.setdefault(cfn, cfl)
                    cfl = None
                elif key == "calls":
                    pending_call = int(val.split()[0])
                elif line.startswith("cmd:"):
                    self.cmd = line[4:].strip()
                elif line.startswith("events:"):
                    self.events = line.split()[1:]
                elif line.startswith("totals:") or line.startswith("summary:"):
                    self.totals = [int(x) for x in line.split()[1:]]

    @staticmethod
    def _name(table, val):
        m = re.match(r"\((\d+)\)(?: (.*))?$", val)
        if not m:
            return val
        if m.group(2) is not None:
            table[m.group(1)] = m.group(2)
        return table.get(m.group(1), val)

    def merge(self, other):
        """Add another profile of the same role (another thread of it)."""
        for fn, per in other.self_cost.items():
            for layer, ir in per.items():
                self.self_cost[fn][layer] += ir
        for fn, n in other.self_sys.items():
            self.self_sys[fn] += n
        for key, (n, ir, s, site) in other.edges.items():
            e = self.edges[key]
            e[0] += n
            e[1] += ir
            e[2] += s
            if e[3] is None:
                e[3] = site
        for fn, n in other.calls_in.items():
            self.calls_in[fn] += n
        for fn, fl in other.fn_file.items():
            self.fn_file.setdefault(fn, fl)

    def fn_layer(self, fn):
        return layer_of_file(self.fn_file.get(fn))

    def by_function(self):
        """Ir per function (its own lines, inlined code included, and the
        library code it calls), and syscalls: the finer view."""
        return self.by_layer(per_function=True)

    def by_layer(self, per_function=False):
        """Ir and syscalls per layer: each line in the layer of its file;
        lines of library code in the layer of the function they are in, or
        of the call site that reached it."""
        layers = defaultdict(int)
        sysc = defaultdict(int)
        incl = defaultdict(int)
        isys = defaultdict(int)
        to_own = defaultdict(int)
        for fn, per in self.self_cost.items():
            incl[fn] += sum(per.values())
            isys[fn] += self.self_sys[fn]
        for (a, b), (n, ir, s, _) in self.edges.items():
            incl[a] += ir
            isys[a] += s
            if self.fn_layer(b) is not None:
                to_own[a] += ir
        for fn, per in self.self_cost.items():
            own = self.fn_layer(fn)
            if own is None:
                continue  # library code: counted at its call sites below
            for layer, ir in per.items():
                layers[fn if per_function else (layer or own)] += ir
            sysc[fn if per_function else own] += self.self_sys[fn]
        for (a, b), (n, ir, s, site) in self.edges.items():
            own = self.fn_layer(a)
            if own is None or self.fn_layer(b) is not None:
                continue
            # Library code called from a layer: its cost, less what it
            # called back in our layers (counted there by their own lines).
            share = 1.0 - (to_own[b] / incl[b] if incl[b] else 0.0)
            key = a if per_function else (site or own)
            layers[key] += round(ir * share)
            sysc[key] += s
        # Library code called from nowhere we know counts as other.
        # Library code reached from a layer, directly or through other
        # library code, is counted at that layer's call site already.
        callees = defaultdict(set)
        for (a, b) in self.edges:
            callees[a].add(b)
        reached = {b for (a, b) in self.edges if self.fn_layer(a) is not None and self.fn_layer(b) is None}
        todo = list(reached)
        while todo:
            for b in callees[todo.pop()]:
                if self.fn_layer(b) is None and b not in reached:
                    reached.add(b)
                    todo.append(b)
        for fn, per in self.self_cost.items():
            if self.fn_layer(fn) is None and fn not in reached:
                layers["other"] += sum(per.values())
        return layers, sysc

    def calls_to(self, pattern):
        rx = re.compile(pattern)
        return sum(n for fn, n in self.calls_in.items() if rx.search(fn))


# A profile file per process is CASE.RUN.PID; per thread (both ends in one
# process), CASE.RUN.PID-THREAD.
PROFILE_FILE = r"\.([a-z])\.(\d+)(-\d+)?$"
# The echo's thread runs the echo loop; every other thread of that process
# counts for the source.
ECHO_THREAD = re.compile(r"^c?fn=\(\d+\) ferry(_cli)?::echo::serve$")


def role_of(path, threaded):
    """"echo" or "source": a process by its command line (the echo process
    is started as `... echo ...`), a thread by whether it ran the echo."""
    with open(path, errors="replace") as f:
        if threaded:
            return "echo" if any(ECHO_THREAD.match(l) for l in f) else "source"
        words = next((l[4:].split() for l in f if l.startswith("cmd:")), [])
    return "echo" if len(words) > 1 and words[1] == "echo" else "source"


def load(dirpath):
    """case -> run -> role -> Profile (threads of one role merged)."""
    profiles = defaultdict(lambda: defaultdict(dict))
    for name in sorted(os.listdir(dirpath)):
        m = re.match(r"(.+)" + PROFILE_FILE, name)
        path = os.path.join(dirpath, name)
        if not m or m.group(1).endswith(("-atomics", "-floor")) or os.path.getsize(path) == 0:
            continue
        p = Profile(path)
        role = role_of(path, m.group(4) is not None)
        run = profiles[m.group(1)][m.group(2)]
        if role in run:
            run[role].merge(p)
        else:
            run[role] = p
    return profiles


def polls(p, poll_rx):
    return p.calls_to(poll_rx)


def solve(case, runs, empty_from=None, view="by_layer"):
    """Per role and layer: instructions per message, and per empty poll.

    Runs a and b differ in the number of messages, a and c (if there is a c)
    only in the pause before each round trip. With E the empty polls (polls
    less messages) and L a layer's count:
        L = setup + messages * s + E * e
    c - a gives e (on the echo, whose empty polls the pause multiplies);
    b - a then gives s, for both processes."""
    rx = case["poll"]
    n = {r: case["runs"][r]["messages"] for r in case["runs"]}
    layers = {r: {role: getattr(runs[r][role], view)() for role in runs[r]} for r in runs}
    empties = {r: {role: polls(runs[r][role], rx) - n[r] for role in runs[r]} for r in runs}
    if empty_from is not None:
        e, esys = empty_from
    else:
        da = empties["c"]["echo"] - empties["a"]["echo"]
        if da <= 0:
            raise SystemExit(f"{case['label']}: the paused run did not poll more ({empties})")
        la, lc = layers["a"]["echo"][0], layers["c"]["echo"][0]
        sa, sc = layers["a"]["echo"][1], layers["c"]["echo"][1]
        e = {k: (lc.get(k, 0) - la.get(k, 0)) / da for k in set(la) | set(lc)}
        esys = {k: (sc.get(k, 0) - sa.get(k, 0)) / da for k in set(sa) | set(sc)}
    dn = n["b"] - n["a"]
    per = {}
    sysper = {}
    for role in ("source", "echo"):
        (la, sa), (lb, sb) = layers["a"][role], layers["b"][role]
        de = empties["b"][role] - empties["a"][role]
        per[role] = {k: (lb.get(k, 0) - la.get(k, 0) - de * e.get(k, 0.0)) / dn for k in set(la) | set(lb) | set(e)}
        # System calls of the layers (the harness's clock reads are system
        # calls under valgrind, which has no vDSO).
        sysper[role] = sum(v for k, v in sb.items() if k != "harness") - sum(v for k, v in sa.items() if k != "harness")
        sysper[role] -= de * sum(v for k, v in esys.items() if k != "harness")
        sysper[role] /= dn
        # How much of the difference was empty polls: the part that rests on
        # the price of one empty poll (a poll during setup may cost a little
        # more or less than one later), so a bound on the error.
        per[role]["(empty polls taken out)"] = de * sum(v for k, v in e.items() if k != "harness") / dn
    return per, sysper, e, esys, empties


@functools.lru_cache(maxsize=None)
def atomic_addresses(binary):
    """Addresses of the locked read-modify-write instructions (x86 `lock`
    prefix, and `xchg` with memory, locked by definition) of `binary`."""
    import subprocess

    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", binary], capture_output=True, text=True).stdout
    # An `xchg` of two registers is not locked: `xchg %ax,%ax` is the
    # two-byte no-op that pads code for alignment. Only one with a memory
    # operand (parenthesized in AT&T syntax) counts.
    rx = re.compile(r"^\s+([0-9a-f]+):\s+(lock |xchg\S*\s+\S*\()")
    return {int(m.group(1), 16) for m in map(rx.match, text.splitlines()) if m}


def instr_lines(path):
    """The lines of a profile made with --dump-instr=yes (positions: instr
    line), walked once for the readers below: ("spec", key, value) for each
    specification line, ("cost", address, Ir) for each cost line of the
    function's own instructions (the cost line after `calls=` is the
    call's inclusive cost, not an instruction of the function: skipped)."""
    pending = False
    last = 0
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            if line.startswith("0x") or line[0] in "+-*":
                parts = line.split()
                pos = parts[0]
                if pos.startswith("0x"):
                    last = int(pos, 16)
                elif pos[0] == "+":
                    last += int(pos[1:])
                elif pos[0] == "-":
                    last -= int(pos[1:])
                if pending:
                    pending = False
                elif len(parts) > 2:
                    yield "cost", last, int(parts[2])
                continue
            key, _, val = line.partition("=")
            if key == "calls":
                pending = True
            yield "spec", key, val


def compressed_name(names, val):
    """The name a specification value stands for: `(id) name` defines the
    id, `(id)` refers to it (callgrind's name compression)."""
    m = re.match(r"\((\d+)\)(?: (.*))?$", val)
    if not m:
        return val
    if m.group(2) is not None:
        names[m.group(1)] = m.group(2)
    return names.get(m.group(1))


def atomics_per_function(path, addresses):
    """Executions of the given instructions per function, from a profile
    made with --dump-instr=yes."""
    names = {}
    fn = None
    res = defaultdict(int)
    for kind, a, b in instr_lines(path):
        if kind == "cost":
            if a in addresses:
                res[fn] += b
        elif a in ("fn", "cfn"):
            name = compressed_name(names, b)
            if a == "fn":
                fn = name
    return res


def print_atomics(d, cases):
    """Locked read-modify-writes per message (runs b - a of the `atomics`
    profiles; the empty polls of either system have none)."""
    for name, case in cases.items():
        runs = case.get("atomics")
        if not runs:
            continue
        per_run = defaultdict(dict)
        for f in sorted(os.listdir(d)):
            m = re.match(re.escape(name) + r"-atomics" + PROFILE_FILE, f)
            path = os.path.join(d, f)
            if not m or os.path.getsize(path) == 0:
                continue
            with open(path, errors="replace") as fh:
                cmd = next((l[4:].split() for l in fh if l.startswith("cmd:")), [])
            role = role_of(path, m.group(3) is not None)
            counts = atomics_per_function(path, atomic_addresses(cmd[0]))
            mine = per_run[m.group(1)].setdefault(role, defaultdict(int))
            for k, v in counts.items():
                mine[k] += v
        if set(per_run) != {"a", "b"}:
            continue
        dn = runs["b"] - runs["a"]
        print(f"\n== {case['label']}: locked read-modify-writes per {case['unit']}")
        for role in ("source", "echo"):
            a, b = per_run["a"].get(role, {}), per_run["b"].get(role, {})
            rows = [((b.get(k, 0) - a.get(k, 0)) / dn, k) for k in set(a) | set(b)]
            rows = sorted((r for r in rows if r[0] >= 0.05), reverse=True)
            print(f"   {role}: {sum(r[0] for r in rows):.1f}")
            for v, k in rows:
                print(f"     {v:5.1f}  {k[:110]}")


def straight_line(path, file_part):
    """Ir per instruction address of the lines of files containing
    `file_part`, from a profile made with --dump-instr=yes."""
    names = {}
    fl = fi = None
    res = defaultdict(int)
    for kind, a, b in instr_lines(path):
        if kind == "cost":
            if file_part in (fi or fl or ""):
                res[a] += b
        elif a in ("fl", "fi", "fe", "cfi", "cfl"):
            name = compressed_name(names, b)
            if a == "fl":
                fl, fi = name, None
            elif a in ("fi", "fe"):
                fi = None if name == fl else name
    return res


def print_floor(d, cases):
    """The floor's instructions per round trip: each instruction of its
    ping-pong (the lines of `file`) counted once per round trip at most,
    that is the spin loops as if they found the line at the first look."""
    for name, case in cases.items():
        if "floor_file" not in case:
            continue
        per_run = defaultdict(dict)
        for f in sorted(os.listdir(d)):
            m = re.match(re.escape(name) + r"\.([ab])\.(\d+)$", f)
            if not m:
                continue
            path = os.path.join(d, f)
            with open(path, errors="replace") as fh:
                cmd = next((l[4:].split() for l in fh if l.startswith("cmd:")), [])
            role = "echo" if len(cmd) > 1 and cmd[1] == "echo" else "source"
            per_run[m.group(1)][role] = straight_line(path, case["floor_file"])
        if set(per_run) != {"a", "b"}:
            continue
        dn = case["runs"]["b"]["messages"] - case["runs"]["a"]["messages"]
        print(f"\n== {case['label']}: instructions per {case['unit']}, each spin loop once")
        for role in ("source", "echo"):
            a, b = per_run["a"].get(role, {}), per_run["b"].get(role, {})
            n = sum(max(0.0, min((b.get(k, 0) - a.get(k, 0)) / dn, 1.0)) for k in set(a) | set(b))
            print(f"   {role}: {n:.0f}")


def main():
    args = sys.argv[1:]
    functions = 0
    if args[:1] == ["--functions"]:
        functions = float(args[1])
        args = args[2:]
    if len(args) != 1:
        raise SystemExit(__doc__)
    d = args[0]
    empty_fn = {}
    with open(os.path.join(d, "cases.json")) as f:
        cases = json.load(f)
    profiles = load(d)
    out = {}
    empty = {}
    for name, case in cases.items():
        if "floor_file" in case:
            continue
        runs = profiles.get(name, {})
        missing = [r for r in case["runs"] if set(runs.get(r, {})) != {"source", "echo"}]
        if missing:
            print(f"{name}: profiles missing for run(s) {missing} (did the run fail?)", file=sys.stderr)
            continue
        src = case.get("empty_poll_from")
        per, sysper, e, esys, empties = solve(case, runs, empty.get(src) if src else None)
        empty[name] = (e, esys)
        keys = [k for k in ORDER if any(abs(per[r].get(k, 0)) >= 0.5 for r in per)]
        res = {
            "label": case["label"],
            "unit": case["unit"],
            "messages": {r: case["runs"][r]["messages"] for r in case["runs"]},
            "empty_polls": empties,
            "empty_poll": {k: round(v, 1) for k, v in e.items() if abs(v) >= 0.05},
            "empty_poll_total": round(sum(v for k, v in e.items() if k != "harness"), 1),
            "per_message": {k: {r: round(per[r].get(k, 0)) for r in per} for k in keys},
            "total_without_harness": {
                r: round(sum(v for k, v in per[r].items() if k not in ("harness", "(empty polls taken out)"))) for r in per
            },
            "empty_polls_taken_out": {r: round(per[r]["(empty polls taken out)"]) for r in per},
            "syscalls_per_message": {r: round(sysper[r], 3) for r in sysper},
        }
        out[name] = res
        print_case(res, keys)
        if functions:
            fper, _, fe, _, _ = solve(case, runs, empty_fn.get(src) if src else None, view="by_function")
            empty_fn[name] = (fe, {})
            print(f"   per function (>= {functions} instructions per {res['unit']}):")
            for role in ("source", "echo"):
                rows = sorted(
                    ((v, k) for k, v in fper[role].items() if v >= functions and not k.startswith("(")), reverse=True
                )
                for v, k in rows:
                    print(f"     {role:<7}{v:>7.0f}  {k[:120]}")
    print_atomics(d, cases)
    print_floor(d, cases)
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n(written: {os.path.join(d, 'summary.json')})")


def print_case(res, keys):
    unit = res["unit"]
    print(f"\n== {res['label']}: instructions per {unit}, empty polls taken out")
    print(f"   {'layer':<22}{'source':>10}{'echo':>10}{'both':>10}")
    for k in keys:
        r = res["per_message"][k]
        print(f"   {k:<22}{r['source']:>10}{r['echo']:>10}{r['source'] + r['echo']:>10}")
    t = res["total_without_harness"]
    print(f"   {'total, no harness':<22}{t['source']:>10}{t['echo']:>10}{t['source'] + t['echo']:>10}")
    s = res["syscalls_per_message"]
    print(f"   system calls per {unit} (no harness): source {s['source']}, echo {s['echo']}")
    print(f"   one empty poll: {res['empty_poll_total']} instructions (harness loop excluded)")
    x = res["empty_polls_taken_out"]
    print(f"   empty polls taken out per {unit}: source {x['source']}, echo {x['echo']}")
    print(f"   messages per run: {res['messages']}; empty polls: {res['empty_polls']}")


if __name__ == "__main__":
    main()
