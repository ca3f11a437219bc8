#!/usr/bin/env bash
# A cluster of N "machines" with their own addresses on one Linux machine, to rehearse (and
# test) multi-node runs: each node is a network namespace at 10.77.0.<i>/24 on a private
# bridge, and its processes live in a PID namespace of their own, so killing a node kills
# every process on it at once, as a lost machine would. The file system stays shared (like a
# cluster's NFS home), except Ray's temp directory (/tmp/ray), which is private per node.
#
#   dir=$(scripts/two_node_cluster.sh up)              # 2 nodes (--nodes N for more); prints DIR
#   scripts/two_node_cluster.sh exec "$dir" 1 ray start --head --node-ip-address 10.77.0.1 --port 6379
#   scripts/two_node_cluster.sh exec "$dir" 2 ray start --address 10.77.0.1:6379 --node-ip-address 10.77.0.2
#   scripts/two_node_cluster.sh exec "$dir" 1 arbor train configs/quickstart.yaml ray.address=10.77.0.1:6379
#   scripts/two_node_cluster.sh kill "$dir" 2          # node 2 is lost: every process on it dies
#   scripts/two_node_cluster.sh start "$dir" 2         # a fresh machine at node 2's address
#   scripts/two_node_cluster.sh down "$dir"            # kill every node, remove the namespaces
#
# `exec DIR I CMD...` runs CMD on node I (its network, processes and mounts) in the current
# directory with the caller's environment; `address DIR I` prints node I's address. Each
# cluster's namespaces carry a random name (several clusters can run side by side), and
# `ray stop` run through `exec` stops only that node's Ray.
#
# Needs Linux, root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 (`ip`) and util-linux
# (`unshare`, `nsenter`); otherwise `up` fails with the reason. ARBOR_CLUSTER_SUBNET
# (default 10.77.0) sets the first three bytes of the addresses: traffic stays between the
# namespaces this script creates.
set -euo pipefail

SUBNET=${ARBOR_CLUSTER_SUBNET:-10.77.0}
usage() {
    sed -n '2,24p' "$0" >&2
    exit 2
}
die() {
    echo "two_node_cluster.sh: $*" >&2
    exit 1
}

# The directory Ray keeps its sockets, logs and session files in, on every node of ours
# (ray._common.utils.get_default_ray_temp_dir): made private per node by a bind mount.
ray_temp_dir() {
    echo "${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray"
}

check_tools() {
    [ "$(uname -s)" = Linux ] || die "needs Linux network and PID namespaces (this is $(uname -s))"
    local tool
    for tool in ip unshare nsenter python3; do
        command -v "$tool" >/dev/null || die "needs '$tool' on PATH (ip: iproute2; unshare, nsenter: util-linux)"
    done
}

# node_pid DIR I: the process id (in this PID namespace) of node I's init, its PID 1.
node_pid() {
    local file=$1/node$2.pid
    [ -s "$file" ] || die "node $2 of $1 is not running (start it: $0 start $1 $2)"
    local pid
    pid=$(cat "$file")
    kill -0 "$pid" 2>/dev/null || die "node $2 of $1 is not running (it was killed; start it: $0 start $1 $2)"
    echo "$pid"
}

start_node() {
    local dir=$1 i=$2 name
    name=$(cat "$dir/name")
    local private=$dir/node$i/ray temp
    temp=$(ray_temp_dir)
    mkdir -p "$private" "$temp"
    # PID 1 of the node: mounts the private Ray directory, then reaps orphans until killed
    # (a PID namespace dies with its PID 1, taking every process in it).
    ip netns exec "$name-n$i" unshare --pid --fork --mount-proc --propagation private python3 -c '
import os, signal, subprocess, sys, time
subprocess.run(["mount", "--bind", sys.argv[1], sys.argv[2]], check=True)
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
open(sys.argv[3], "w").write("ready")
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.5)
' "$private" "$temp" "$dir/node$i.ready" >"$dir/node$i.log" 2>&1 &
    local unshare_pid=$! child="" _
    for _ in $(seq 100); do
        child=$(cat "/proc/$unshare_pid/task/$unshare_pid/children" 2>/dev/null | tr -d ' ') || true
        [ -n "$child" ] && [ -e "$dir/node$i.ready" ] && break
        kill -0 "$unshare_pid" 2>/dev/null || die "node $i did not start: $(cat "$dir/node$i.log")"
        sleep 0.1
    done
    [ -n "$child" ] && [ -e "$dir/node$i.ready" ] || die "node $i did not start within 10 s: $(cat "$dir/node$i.log")"
    rm -f "$dir/node$i.ready"
    echo "$child" >"$dir/node$i.pid"
}

kill_node() {
    local dir=$1 i=$2 pid
    [ -s "$dir/node$i.pid" ] || return 0
    pid=$(cat "$dir/node$i.pid")
    kill -KILL "$pid" 2>/dev/null || true
    local _
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    rm -f "$dir/node$i.pid"
}

up() {
    local nodes=2 dir=""
    while [ $# -gt 0 ]; do
        case $1 in
            --nodes) nodes=$2; shift 2 ;;
            --dir) dir=$2; shift 2 ;;
            *) usage ;;
        esac
    done
    [ "$nodes" -ge 1 ] && [ "$nodes" -le 250 ] || die "--nodes must be 1..250"
    check_tools
    # Short and random: interface names have at most 15 characters.
    local name
    name=ab$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
    dir=${dir:-${TMPDIR:-/tmp}/arbor-cluster-$name}
    mkdir -p "$dir"
    echo "$name" >"$dir/name"
    echo "$nodes" >"$dir/nodes"
    echo "$SUBNET" >"$dir/subnet"
    trap 'down "$dir" >/dev/null 2>&1 || true' ERR
    ip netns add "$name-sw" || die "cannot create network namespaces (needs root or CAP_NET_ADMIN)"
    ip -n "$name-sw" link add "${name}br" type bridge
    ip -n "$name-sw" link set "${name}br" up
    local i
    for i in $(seq "$nodes"); do
        ip netns add "$name-n$i"
        ip -n "$name-n$i" link set lo up
        # Each node's interface has its own name (as on machines that differ): an address
        # must be found from the node's own interfaces, not assumed alike everywhere.
        ip link add "${name}n$i" type veth peer name "${name}s$i"
        ip link set "${name}n$i" netns "$name-n$i"
        ip link set "${name}s$i" netns "$name-sw"
        ip -n "$name-sw" link set "${name}s$i" master "${name}br"
        ip -n "$name-sw" link set "${name}s$i" up
        ip -n "$name-n$i" addr add "$SUBNET.$i/24" dev "${name}n$i"
        ip -n "$name-n$i" link set "${name}n$i" up
        start_node "$dir" "$i"
    done
    trap - ERR
    echo "$dir"
}

down() {
    local dir=$1 name nodes i
    [ -s "$dir/name" ] || die "$dir is not a cluster directory (no $dir/name)"
    name=$(cat "$dir/name")
    nodes=$(cat "$dir/nodes")
    for i in $(seq "$nodes"); do
        kill_node "$dir" "$i"
        ip netns del "$name-n$i" 2>/dev/null || true
    done
    ip netns del "$name-sw" 2>/dev/null || true
    rm -rf "$dir"
}

[ $# -ge 1 ] || usage
command=$1
shift
case $command in
    up) up "$@" ;;
    down) [ $# -eq 1 ] || usage; down "$1" ;;
    start) [ $# -eq 2 ] || usage; kill_node "$1" "$2"; start_node "$1" "$2" ;;
    kill) [ $# -eq 2 ] || usage; kill_node "$1" "$2" ;;
    address) [ $# -eq 2 ] || usage; echo "$(cat "$1/subnet").$2" ;;
    exec)
        [ $# -ge 3 ] || usage
        dir=$1 i=$2
        shift 2
        pid=$(node_pid "$dir" "$i")
        exec nsenter --target "$pid" --net --pid --mount --wd="$PWD" -- "$@"
        ;;
    *) usage ;;
esac
