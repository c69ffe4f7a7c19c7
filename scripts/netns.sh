#!/usr/bin/env bash
# netns.sh: a multi-node test bed on one machine, out of Linux network namespaces.
#
# Each "node" is a network namespace PREFIX-n<k> with one interface, eth0, addressed
# SUBNET.<k+1>/24 (node 0 is SUBNET.1), plus lo. The eth0 of every node is one end of a veth
# pair whose other end, v<k>, is a port of the bridge br0 in a namespace of its own, PREFIX-sw
# (the "switch"; with --racks, of its rack's bridge there, see below). The root namespace's
# networking is never touched: no interface, address, route or firewall rule is added there,
# so only addresses made here ever receive the traffic. The
# namespaces share everything else with the machine (file system, /dev/shm, processes, host
# name), which is why `run` sets OXCCL_NODE_ID=node<k>: ranks in different namespaces must not
# count as one node (they would otherwise try shared memory with each other).
#
# Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and a working `ip netns` (iproute2). Without
# them every subcommand except --help prints one line starting with "SKIP:" saying why, on
# stderr, and exits with 77 (the automake "skipped" code; the tests treat it as a skip).
#
# Usage:
#   scripts/netns.sh up --nodes N [--prefix P] [--subnet A.B.C] [--rate R]
#                       [--racks R [--rack-rate R2]]
#       Create PREFIX-sw (bridge br0, or with --racks rk0.. and spine) and PREFIX-n0 ..
#       PREFIX-n<N-1>, N in 1..16 (2 to 4 is the usual), addresses A.B.C.1 .. A.B.C.N. Fails
#       (exit 1) if any of them already exists.
#   scripts/netns.sh down [--prefix P]
#       Stop every process still inside PREFIX-* (SIGTERM, 5 s, then SIGKILL, by pid) and
#       delete the namespaces. Idempotent: succeeds when there is nothing to remove.
#   scripts/netns.sh run --nodes N [--prefix P] [--subnet A.B.C] [--port PORT] [--nproc K]
#                        [--timeout S] [--job-id ID] [--fail-grace S] [--rate R]
#                        [--racks R [--rack-rate R2]] -- CMD [ARGS...]
#       `up`, then in every node k at once:
#         ip netns exec PREFIX-n<k> env OXCCL_NODE_ID=node<k> OXCCL_BIN launch --nnodes N
#           --node-rank k --master-addr A.B.C.1 --master-port PORT -n K --job-id ID
#           [--timeout S] -- CMD [ARGS...]
#       Node 0's launcher hosts the store on A.B.C.1:PORT. Every line a node writes to stdout
#       (stderr) is written to stdout (stderr) as "[node k] " + the line, and the launcher's
#       own "[R] " rank prefix follows, e.g. "[node 1] [3] RESULT rank=3 ok". CMD runs in
#       the current directory, so relative paths work as they do outside.
#       Waits for every node. Exit status: 0 if every node's launcher exited 0, else the code
#       of the first node seen failing (e.g. 124 for --timeout). Once a node has failed, the
#       others get --fail-grace seconds (default 10) to finish on their own (their launchers
#       learn of the failure through the store and stop their ranks), then their processes are
#       stopped. The namespaces are
#       removed when the script exits, whether it succeeds, fails or gets SIGINT/SIGTERM/SIGHUP
#       (not after SIGKILL: then run `down`).
#   scripts/netns.sh link-down --node k [--prefix P]
#   scripts/netns.sh link-up --node k [--prefix P]
#       Set node k's switch port (v<k> in PREFIX-sw) down or up: node k is cut off from the
#       others, like a pulled cable (its eth0 loses carrier; packets are dropped, nothing is
#       reset, so peers see silence, not a closed connection).
#   scripts/netns.sh --help
#
# Options:
#   --nodes N      number of nodes (up, run)
#   --prefix P     name prefix of the namespaces, [A-Za-z0-9][A-Za-z0-9_.-]*, at most 40
#                  characters (default "oxccl"). Different prefixes let several jobs run at
#                  once; the subnets need not differ (each node sees only its own switch).
#   --subnet A.B.C first three octets of the /24 (default 10.77.0)
#   --port PORT    store port on node 0 (default 29500)
#   --nproc K      ranks per node, `oxccl launch -n K` (default 1)
#   --timeout S    passed to every `oxccl launch --timeout S` (kill the job after S seconds)
#   --job-id ID    passed as `oxccl launch --job-id ID` (default: the prefix, so concurrent
#                  jobs do not share /dev/shm segment names)
#   --fail-grace S see `run` (default 10)
#   --rate RATE    (up, run) limit every node's link to RATE each way, like a NIC's line rate
#                  (tc tbf on eth0 and on the switch port), e.g. 5gbit; default: no limit (the
#                  veth pairs then run as fast as the CPU copies)
#   --racks R      (up, run) R racks of N/R consecutive nodes each (R divides N; default 1,
#                  one bridge for every node): PREFIX-sw then holds one bridge per rack, rk<r>,
#                  with rack r's switch ports, and a spine bridge, spine; each rack's bridge
#                  reaches the spine through a veth pair, up<r> (in rk<r>) and dn<r> (in
#                  spine): the rack's uplink, which the rack's nodes share for traffic to other
#                  racks. Traffic inside a rack never crosses the spine.
#   --rack-rate R2 (up, run; needs --racks R, R >= 2) limit every rack's uplink to R2 each
#                  way (tc tbf on up<r> and dn<r>), e.g. 1gbit under --rate 10gbit: an
#                  oversubscribed tier above the nodes' links; default: no limit
#   --node k       the node (link-down, link-up)
#
# Environment: OXCCL_BIN, the oxccl binary (default: target/release/oxccl under the repository
# root if it exists, else `oxccl` on PATH). Everything else in the environment reaches the
# ranks, e.g. OXCCL_DEBUG=info or OXCCL_TIMEOUT=10.
#
# Exit codes: 0 success; 77 skipped (not root, no iproute2, `ip netns add` refused); 2 bad
# command line; 1 set-up error (namespaces exist, oxccl binary missing, ip failed); otherwise
# the first failing node's code (run).
#
# Examples:
#   scripts/netns.sh run --nodes 2 --nproc 2 -- target/release/examples/01_all_reduce
#   OXCCL_DEBUG=info scripts/netns.sh run --nodes 2 --nproc 2 --prefix job7 -- ./train
#   scripts/netns.sh run --nodes 2 --nproc 2 -- target/release/oxccl perf all-reduce -b 64M -e 64M
#   scripts/netns.sh link-down --node 1 --prefix job7   # from another shell, mid-run
#   scripts/netns.sh down --prefix job7

set -euo pipefail

# ip lives in /usr/sbin or /sbin, which a non-login root shell may not have on its PATH.
export PATH="$PATH:/usr/sbin:/sbin"

readonly SCRIPT_PATH="${BASH_SOURCE[0]}"
REPO_ROOT="$(cd "$(dirname "$SCRIPT_PATH")/.." && pwd)"
readonly REPO_ROOT
readonly ME="netns.sh"

usage() {
    # The comment block at the top of this file, without the leading "# ".
    sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "$SCRIPT_PATH"
}

die() {
    echo "$ME: $*" >&2
    exit 1
}

usage_error() {
    echo "$ME: $*" >&2
    echo "$ME: see $SCRIPT_PATH --help" >&2
    exit 2
}

skip() {
    echo "SKIP: $*" >&2
    exit 77
}

# Skips (77) unless we are root and `ip` exists.
require_root() {
    if ! command -v ip >/dev/null 2>&1; then
        skip "the ip command (iproute2) is not installed (apt-get install iproute2)"
    fi
    local uid
    uid="$(id -u)"
    if [[ "$uid" -ne 0 ]]; then
        skip "network namespaces need root, and this runs as uid $uid"
    fi
}

# Namespaces named PREFIX-sw or PREFIX-n<k> that exist now, one a line.
list_ns() {
    local prefix="$1" name
    ip netns list 2>/dev/null | while read -r name _; do
        if [[ "$name" == "$prefix-sw" || "$name" =~ ^"$prefix"-n[0-9]+$ ]]; then
            echo "$name"
        fi
    done
}

# Stops every process inside the given namespaces: SIGTERM, up to $grace seconds, SIGKILL.
stop_ns_procs() {
    local grace="$1" ns pid
    shift
    local -a pids=()
    for ns in "$@"; do
        while read -r pid; do
            [[ -n "$pid" ]] && pids+=("$pid")
        done < <(ip netns pids "$ns" 2>/dev/null || true)
    done
    ((${#pids[@]} > 0)) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local tenths=$((grace * 10)) alive
    while ((tenths > 0)); do
        alive=0
        for pid in "${pids[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then
                alive=1
                break
            fi
        done
        ((alive)) || return 0
        sleep 0.1
        tenths=$((tenths - 1))
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

do_down() {
    local prefix="$1" ns
    local -a all=()
    while read -r ns; do
        [[ -n "$ns" ]] && all+=("$ns")
    done < <(list_ns "$prefix")
    ((${#all[@]} > 0)) || return 0
    stop_ns_procs 5 "${all[@]}"
    for ns in "${all[@]}"; do
        ip netns del "$ns" 2>/dev/null || true
    done
}

# Creates the namespaces. Sets CREATED=1 once something of ours exists, so that a failure
# half-way is cleaned up by the caller, but namespaces of someone else (same prefix) never are.
CREATED=0
do_up() {
    local prefix="$1" nodes="$2" subnet="$3" k ns existing out
    existing="$(list_ns "$prefix")"
    if [[ -n "$existing" ]]; then
        die "namespaces with prefix '$prefix' already exist (${existing//$'\n'/ }): another job uses this prefix, or run '$SCRIPT_PATH down --prefix $prefix'"
    fi
    if ! out="$(ip netns add "$prefix-sw" 2>&1)"; then
        skip "'ip netns add $prefix-sw' failed: ${out:-no message} (network namespaces unavailable here)"
    fi
    CREATED=1
    local sw="$prefix-sw"
    ip -n "$sw" link set lo up
    local per_rack=$((nodes / RACKS)) r
    if ((RACKS == 1)); then
        ip -n "$sw" link add br0 type bridge
        ip -n "$sw" link set br0 up
    else
        ip -n "$sw" link add spine type bridge
        ip -n "$sw" link set spine up
        for ((r = 0; r < RACKS; r++)); do
            ip -n "$sw" link add "rk$r" type bridge
            ip -n "$sw" link set "rk$r" up
            # The rack's uplink: up<r> a port of its bridge, dn<r> a port of the spine.
            ip -n "$sw" link add "up$r" type veth peer name "dn$r"
            ip -n "$sw" link set "up$r" master "rk$r"
            ip -n "$sw" link set "dn$r" master spine
            ip -n "$sw" link set "up$r" up
            ip -n "$sw" link set "dn$r" up
            if [[ -n "$RACK_RATE" ]]; then
                # Both ways: the rack's egress to the spine and the spine's egress to the rack.
                tc -n "$sw" qdisc add dev "up$r" root tbf rate "$RACK_RATE" burst 1mb latency 100ms
                tc -n "$sw" qdisc add dev "dn$r" root tbf rate "$RACK_RATE" burst 1mb latency 100ms
            fi
        done
    fi
    for ((k = 0; k < nodes; k++)); do
        ns="$prefix-n$k"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # Both ends are created inside our namespaces: v<k> in the switch, eth0 in the node.
        ip -n "$sw" link add "v$k" type veth peer name eth0 netns "$ns"
        if ((RACKS == 1)); then
            ip -n "$sw" link set "v$k" master br0
        else
            ip -n "$sw" link set "v$k" master "rk$((k / per_rack))"
        fi
        ip -n "$sw" link set "v$k" up
        ip -n "$ns" addr add "$subnet.$((k + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [[ -n "$RATE" ]]; then
            # A NIC's line rate, both ways: the node's egress and the switch port's egress.
            tc -n "$ns" qdisc add dev eth0 root tbf rate "$RATE" burst 1mb latency 100ms
            tc -n "$sw" qdisc add dev "v$k" root tbf rate "$RATE" burst 1mb latency 100ms
        fi
    done
}

do_link() {
    local prefix="$1" node="$2" state="$3" found
    # Listed first, then searched: `list_ns | grep -q` under pipefail fails whenever grep stops
    # reading before list_ns has written everything (SIGPIPE), e.g. while other jobs' namespaces
    # exist.
    found="$(list_ns "$prefix")"
    grep -qxF "$prefix-sw" <<<"$found" ||
        die "no namespace $prefix-sw (is a job with --prefix $prefix running?)"
    ip -n "$prefix-sw" link set "v$node" "$state" ||
        die "cannot set v$node in $prefix-sw $state (is there a node $node?)"
}

find_oxccl() {
    local bin
    if [[ -n "${OXCCL_BIN:-}" ]]; then
        bin="$OXCCL_BIN"
    elif [[ -x "$REPO_ROOT/target/release/oxccl" ]]; then
        bin="$REPO_ROOT/target/release/oxccl"
    elif bin="$(command -v oxccl)"; then
        :
    else
        die "no oxccl binary: build it (cargo build --release --bin oxccl) or set OXCCL_BIN"
    fi
    if [[ "$bin" != */* ]]; then
        bin="$(command -v "$bin")" || die "OXCCL_BIN=$OXCCL_BIN is not on PATH"
    fi
    [[ -x "$bin" ]] || die "$bin is not an executable file"
    # Absolute, so that it does not depend on the directory the ranks start in.
    echo "$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")"
}

# The prefix whose namespaces the exit trap removes (if CREATED=1): set by `run`, and by `up`
# until it has finished.
CLEANUP_PREFIX=""
on_exit() {
    local rc=$?
    trap - EXIT INT TERM HUP
    if [[ -n "$CLEANUP_PREFIX" && "$CREATED" -eq 1 ]]; then
        do_down "$CLEANUP_PREFIX"
    fi
    exit "$rc"
}

install_traps() {
    CLEANUP_PREFIX="$1"
    trap on_exit EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP
}

do_run() {
    local prefix="$1" nodes="$2" subnet="$3" port="$4" nproc="$5" timeout="$6" job_id="$7"
    local fail_grace="$8"
    shift 8
    (($# > 0)) || usage_error "run: no command given (run ... -- CMD [ARGS...])"
    if ((BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1))); then
        die "run needs bash 5.1 or newer (wait -n -p); this is $BASH_VERSION"
    fi
    local bin
    bin="$(find_oxccl)"
    install_traps "$prefix"
    do_up "$prefix" "$nodes" "$subnet"

    local -a extra=(--job-id "${job_id:-$prefix}")
    [[ -n "$timeout" ]] && extra+=(--timeout "$timeout")
    local -A node_of=()
    local -a filters=()
    local k ofd efd
    for ((k = 0; k < nodes; k++)); do
        # The line filters are children of this shell (so that it can wait for them to drain);
        # each fd is closed here right after the node starts, so later children do not hold it.
        exec {ofd}> >(sed -u "s/^/[node $k] /")
        filters+=("$!")
        exec {efd}> >(sed -u "s/^/[node $k] /" >&2)
        filters+=("$!")
        ip netns exec "$prefix-n$k" env OXCCL_NODE_ID="node$k" \
            "$bin" launch --nnodes "$nodes" --node-rank "$k" --master-addr "$subnet.1" \
            --master-port "$port" -n "$nproc" "${extra[@]}" -- "$@" \
            >&"$ofd" 2>&"$efd" {ofd}>&- {efd}>&- &
        node_of[$!]=$k
        exec {ofd}>&- {efd}>&-
    done

    # Wait for the nodes. After the first failure a timer (a `sleep` of ours) joins the wait:
    # when it ends first, the nodes still running are stopped.
    local first_rc=0 rc done_pid timer=""
    while ((${#node_of[@]} > 0)); do
        done_pid=""
        rc=0
        wait -n -p done_pid "${!node_of[@]}" ${timer:+"$timer"} || rc=$?
        [[ -n "$done_pid" ]] || continue
        if [[ "$done_pid" == "$timer" ]]; then
            timer=""
            echo "$ME: stopping node(s) ${node_of[*]}: still running $fail_grace s after the failure" >&2
            local -a left=()
            for k in "${node_of[@]}"; do left+=("$prefix-n$k"); done
            stop_ns_procs 8 "${left[@]}"
            wait "${!node_of[@]}" 2>/dev/null || true
            break
        fi
        k="${node_of[$done_pid]}"
        unset "node_of[$done_pid]"
        if ((rc != 0 && first_rc == 0)); then
            echo "$ME: node $k exited with code $rc" >&2
            first_rc=$rc
            if ((${#node_of[@]} > 0)); then
                sleep "$fail_grace" &
                timer=$!
            fi
        elif ((rc != 0)); then
            echo "$ME: node $k exited with code $rc" >&2
        fi
    done
    if [[ -n "$timer" ]]; then
        kill "$timer" 2>/dev/null || true
    fi
    # Let the output filters drain before the namespaces go and the script exits.
    wait "${filters[@]}" 2>/dev/null || true
    return "$first_rc"
}

# Whether $1 is a decimal integer in $2..=$3.
in_range() {
    [[ "$1" =~ ^[0-9]{1,9}$ ]] || return 1
    ((10#$1 >= $2 && 10#$1 <= $3))
}

main() {
    (($# > 0)) || usage_error "no subcommand (up, down, run, link-down, link-up)"
    local cmd="$1"
    shift
    case "$cmd" in
    -h | --help | help)
        usage
        exit 0
        ;;
    up | down | run | link-down | link-up) ;;
    *) usage_error "unknown subcommand '$cmd'" ;;
    esac

    local nodes="" prefix="oxccl" subnet="10.77.0" port="29500" nproc="1" timeout=""
    local job_id="" node="" fail_grace="10"
    RATE=""
    RACKS=1
    RACK_RATE=""
    local racks_given=0
    while (($# > 0)); do
        case "$1" in
        --) shift; break ;;
        -h | --help) usage; exit 0 ;;
        --nodes | --prefix | --subnet | --port | --nproc | --timeout | --job-id | --node | --fail-grace | --rate | --racks | --rack-rate)
            (($# >= 2)) || usage_error "$1 needs a value"
            case "$1" in
            --nodes) nodes="$2" ;;
            --prefix) prefix="$2" ;;
            --subnet) subnet="$2" ;;
            --port) port="$2" ;;
            --nproc) nproc="$2" ;;
            --timeout) timeout="$2" ;;
            --job-id) job_id="$2" ;;
            --node) node="$2" ;;
            --fail-grace) fail_grace="$2" ;;
            --rate) RATE="$2" ;;
            --racks) RACKS="$2"; racks_given=1 ;;
            --rack-rate) RACK_RATE="$2" ;;
            esac
            shift 2
            ;;
        *)
            if [[ "$cmd" == run ]]; then
                usage_error "unknown option '$1' (the command goes after --)"
            fi
            usage_error "unknown option '$1'"
            ;;
        esac
    done
    if [[ "$cmd" != run ]] && (($# > 0)); then
        usage_error "$cmd takes no command"
    fi

    [[ "$prefix" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$ ]] ||
        usage_error "--prefix '$prefix': use [A-Za-z0-9][A-Za-z0-9_.-]*, at most 40 characters"
    local octet='(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])'
    [[ "$subnet" =~ ^$octet\.$octet\.$octet$ ]] ||
        usage_error "--subnet '$subnet': give three octets, e.g. 10.77.0"
    if [[ "$cmd" == up || "$cmd" == run ]]; then
        in_range "$nodes" 1 16 || usage_error "--nodes must be given, 1..16"
    fi
    in_range "$port" 1 65535 || usage_error "--port '$port': 1..65535"
    in_range "$nproc" 1 4096 || usage_error "--nproc '$nproc': 1..4096"
    [[ "$fail_grace" =~ ^[0-9]+$ ]] || usage_error "--fail-grace '$fail_grace': whole seconds"
    if [[ -n "$timeout" ]]; then
        [[ "$timeout" =~ ^[0-9]+(\.[0-9]+)?$ ]] || usage_error "--timeout '$timeout': seconds"
    fi
    if [[ "$cmd" == link-down || "$cmd" == link-up ]]; then
        [[ "$node" =~ ^[0-9]+$ ]] || usage_error "$cmd needs --node k"
    fi
    if [[ -n "$RATE" ]]; then
        [[ "$RATE" =~ ^[0-9]+(\.[0-9]+)?[kmgt]?bit$ ]] ||
            usage_error "--rate '$RATE': a tc rate such as 5gbit or 800mbit"
    fi
    if ((racks_given)) || [[ -n "$RACK_RATE" ]]; then
        [[ "$cmd" == up || "$cmd" == run ]] ||
            usage_error "--racks and --rack-rate are options of up and run, not $cmd"
    fi
    if [[ "$cmd" == up || "$cmd" == run ]]; then
        nodes=$((10#$nodes))
    fi
    if ((racks_given)); then
        in_range "$RACKS" 1 16 || usage_error "--racks '$RACKS': 1..16"
        RACKS=$((10#$RACKS))
        if ((nodes % RACKS != 0)); then
            usage_error "--racks $RACKS does not divide --nodes $nodes (racks hold equal numbers of consecutive nodes)"
        fi
    fi
    if [[ -n "$RACK_RATE" ]]; then
        ((RACKS > 1)) || usage_error "--rack-rate needs --racks R with R >= 2 (one rack has no uplink)"
        [[ "$RACK_RATE" =~ ^[0-9]+(\.[0-9]+)?[kmgt]?bit$ ]] ||
            usage_error "--rack-rate '$RACK_RATE': a tc rate such as 1gbit or 800mbit"
    fi

    require_root
    case "$cmd" in
    up)
        install_traps "$prefix"
        do_up "$prefix" "$nodes" "$subnet"
        CLEANUP_PREFIX=""
        echo "$ME: up: $prefix-sw, $prefix-n0..$prefix-n$((nodes - 1)) at $subnet.1..$subnet.$nodes"
        ;;
    down) do_down "$prefix" ;;
    run) do_run "$prefix" "$nodes" "$subnet" "$port" "$nproc" "$timeout" "$job_id" "$fail_grace" "$@" ;;
    link-down) do_link "$prefix" "$node" down ;;
    link-up) do_link "$prefix" "$node" up ;;
    esac
}

main "$@"
