#!/usr/bin/env bash
# Run an MPI program with every rank in its own Linux network namespace.
#
# Why: ranks that share a host talk through shared memory (or loopback), which
# hides the cost of the network. Putting each rank in its own namespace, wired
# to the others by veth pairs and a bridge, forces Open MPI's TCP BTL onto a
# real kernel TCP path whose bandwidth/latency can be shaped with tc, so the
# distributed code paths and their communication cost can be tested on one box.
#
# What it builds (all names carry this script's PID, so concurrent runs coexist):
#   namespaces attn-PID-ns0..N-1, each with lo up and a veth (10.213.S.(i+1)/24)
#   whose root-side peer sits on bridge attnbrPID (10.213.S.254, where mpirun's
#   out-of-band channel listens); an ssh-like launch agent that runs Open MPI's
#   daemon inside the namespace owning the target IP. --rate puts a tbf and
#   --delay a netem qdisc on each namespace's egress (so RTT = 2 x DELAY).
#   The program sees ATTN_NETNS=1. Everything is removed on exit.
#
# Usage: scripts/mpirun_netns.sh [--rate RATE] [--delay DELAY] [--launch-timeout S] -np N -- PROGRAM [ARGS...]
#   RATE as tc writes it (10gbit, 1gbit, 500mbit), DELAY likewise (50us, 1ms); 2 <= N <= 4.
#   --launch-timeout S: if the job has printed nothing S seconds after mpirun started, Open MPI's
#   launch stalled (a daemon missing, the job silent until killed): say so, show which
#   daemons and sockets exist, kill it, and launch once more. Only for programs that print as
#   they start (a test binary), never for a benchmark that prints at its end.
# Exit codes: the MPI program's exit code (as mpirun reports it); 2 on bad usage;
#   77 (CTest SKIP_RETURN_CODE) with a "SKIP: reason" line when the host cannot
#   build the namespaces/qdiscs (not root, no CAP_NET_ADMIN, no ip/tc/mpirun, no netem).
set -uo pipefail

usage() { sed -n 's/^# Usage: //p' "$0" >&2; exit 2; }
skip() { echo "SKIP: $*"; exit 77; }

rate="" delay="" np="" launch_timeout=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) rate=${2:?}; shift 2 ;;
    --launch-timeout) launch_timeout=${2:?}; shift 2 ;;
    --delay) delay=${2:?}; shift 2 ;;
    -np|-n) np=${2:?}; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[ $# -ge 1 ] && [[ "$np" =~ ^[2-4]$ ]] && [[ "$launch_timeout" =~ ^[0-9]*$ ]] || usage

command -v ip >/dev/null || skip "no 'ip' command (install iproute2)"
command -v mpirun >/dev/null || skip "no mpirun on PATH (install openmpi-bin)"
if [ -n "$rate$delay" ]; then command -v tc >/dev/null || skip "no 'tc' command (install iproute2)"; fi
[ "$(id -u)" -eq 0 ] || skip "must run as root to create network namespaces"

tag="attn-$$" br="attnbr$$" tmp="" nss=()
cleanup() {
  local ns pid
  for ns in "${nss[@]}"; do
    # Stray orted/ranks after an abort would keep the namespace alive.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null   # also destroys both ends of its veth
  done
  ip link del "$br" 2>/dev/null
  [ -n "$tmp" ] && rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT; trap 'exit 143' TERM

ip netns add "$tag-ns0" 2>/dev/null || skip "'ip netns add' failed (no CAP_NET_ADMIN or no mount rights for /run/netns)"
nss+=("$tag-ns0")
tmp=$(mktemp -d /tmp/attn-netns.XXXXXX)

# Pick a /24 no other interface (e.g. a concurrent run) uses; the lock makes
# choose-and-claim atomic across runs.
exec 9>/tmp/attn-netns.lock; flock 9
s=$(( $$ % 250 + 1 ))
for _ in $(seq 250); do
  # No grep -q: under pipefail, ip ended by SIGPIPE after an early match would read as "free".
  ip -4 -o addr show | grep " 10\.213\.$s\." >/dev/null || break
  s=$(( s % 250 + 1 ))
done
net="10.213.$s"
ip link add "$br" type bridge || skip "cannot create bridge $br"
ip addr add "$net.254/24" dev "$br" && ip link set "$br" up
flock -u 9; exec 9>&-

hosts=""
for i in $(seq 0 $((np - 1))); do
  ns="$tag-ns$i" host="attn$$h$i" peer="attn$$p$i"
  [ "$i" -eq 0 ] || { ip netns add "$ns" || skip "'ip netns add $ns' failed"; nss+=("$ns"); }
  ip link add "$host" type veth peer name "$peer" || skip "cannot create veth pair (CONFIG_VETH?)"
  ip link set "$peer" netns "$ns"
  ip link set "$host" master "$br" up
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$peer" name eth0
  ip -n "$ns" addr add "$net.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  parent="root"
  if [ -n "$delay" ]; then
    ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: netem delay "$delay" 2>/dev/null \
      || skip "netem qdisc unavailable for --delay (kernel lacks CONFIG_NET_SCH_NETEM?)"
    parent="parent 1:1"
  fi
  if [ -n "$rate" ]; then
    # tbf needs a bucket of >= ~1 ms at RATE to reach it, and room for 64 KiB GSO frames.
    bps=$(echo "$rate" | awk '
      match(tolower($0), /^[0-9.]+/) { v = substr($0, 1, RLENGTH); u = tolower(substr($0, RLENGTH + 1))
        m["bit"]=1; m["kbit"]=1e3; m["mbit"]=1e6; m["gbit"]=1e9; m["tbit"]=1e12
        m["bps"]=8; m["kbps"]=8e3; m["mbps"]=8e6; m["gbps"]=8e9
        if (u in m) printf "%d\n", v * m[u] / 8 }')
    [ -n "$bps" ] || { echo "bad --rate '$rate' (use e.g. 10gbit, 500mbit)" >&2; exit 2; }
    burst=$(( bps / 1000 > 131072 ? bps / 1000 : 131072 ))
    ip netns exec "$ns" tc qdisc add dev eth0 $parent handle 10: tbf rate "$rate" burst "$burst" latency 50ms \
      || skip "cannot add tbf qdisc (kernel lacks CONFIG_NET_SCH_TBF?)"
  fi
  echo "$net.$((i + 1)) $ns" >> "$tmp/hosts"
  hosts+="${hosts:+,}$net.$((i + 1)):1"
done

# Open MPI 4.x (ORTE) calls the agent like ssh: AGENT [ssh-opts] HOST CMD...;
# CMD is a shell string, so it is run by sh inside HOST's namespace. Each namespace
# gets its own TMPDIR, as a real host has its own /tmp: the daemons share this host's
# name, so in one /tmp their session directories (/tmp/ompi.HOSTNAME.UID/...) are the
# same path, and the three daemons, started at once, raced to create it; about one
# launch in 16 lost a daemon that way and stalled (3 of 49 and 2 of 31 runs here).
cat > "$tmp/agent" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do
  case "\$1" in -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;; -*) shift ;; *) break ;; esac
done
ns=\$(awk -v h="\$1" '\$1 == h { print \$2 }' "$tmp/hosts"); shift
[ -n "\$ns" ] || { echo "mpirun_netns agent: unknown host" >&2; exit 255; }
mkdir -p "$tmp/\$ns"
exec ip netns exec "\$ns" env TMPDIR="$tmp/\$ns" sh -c "\$*"
EOF
chmod +x "$tmp/agent"

export ATTN_NETNS=1
# pml ob1 + btl tcp,self: UCX/OFI (pml ucx/cm, osc ucx) and vader would bypass
# the TCP BTL. No tree spawn: mpirun launches every daemon itself. bind-to none:
# each "node" believes it owns all cores, so binding would pile ranks onto core 0.
run_mpi() {
  mpirun ${MPIRUN_EXTRA:-} --allow-run-as-root --oversubscribe -np "$np" -H "$hosts" --bind-to none \
    --mca plm_rsh_agent "$tmp/agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca pml ob1 --mca btl tcp,self --mca osc '^ucx' \
    --mca btl_tcp_if_include "$net.0/24" --mca oob_tcp_if_include "$net.0/24" \
    -x ATTN_NETNS "$@"
}
[ -n "$launch_timeout" ] || { run_mpi "$@"; exit $?; }

for attempt in 1 2; do
  out="$tmp/out.$attempt"
  run_mpi "$@" > "$out" 2>&1 &
  job=$! waited=0
  while kill -0 "$job" 2>/dev/null && [ ! -s "$out" ] && [ "$waited" -lt "$launch_timeout" ]; do
    sleep 1; waited=$((waited + 1))
  done
  if [ ! -s "$out" ] && kill -0 "$job" 2>/dev/null; then
    echo "mpirun_netns: the job printed nothing within ${launch_timeout} s of launch (attempt $attempt): Open MPI's launch stalled; killing it" >&2
    for ns in "${nss[@]}"; do  # which daemons came up, and whether each reached mpirun
      echo "mpirun_netns:   $ns: $(ip netns pids "$ns" 2>/dev/null | xargs -r ps -o comm= -p | sort | uniq -c | xargs)," \
           "$(ip netns exec "$ns" ss -Htn state established 2>/dev/null | wc -l) TCP connection(s)" >&2
    done
    kill -TERM "$job" 2>/dev/null; sleep 2; kill -KILL "$job" 2>/dev/null
    for ns in "${nss[@]}"; do for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done; done
    wait "$job" 2>/dev/null
    continue
  fi
  tail -n +1 -f "$out" --pid="$job" &
  follow=$!
  wait "$job"; rc=$?
  wait "$follow" 2>/dev/null
  exit $rc
done
echo "mpirun_netns: the launch stalled twice; giving up" >&2
exit 1
