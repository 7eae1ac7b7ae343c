#!/bin/bash
# two_hosts.sh: run an MPI program on N emulated "hosts" of this machine (N = 2 by default), so that the
# inter-node link is a real network link (veth pairs through a bridge, optionally slowed with tc) and not
# shared memory. Used by scripts/multinode.sh and for the hierarchical-dispatch figures in docs/parallel.md
# and docs/multinode.md (which describes the setup in full). Needs root, iproute2 (ip, tc) and OpenMPI.
# Not a test that CTest runs: it changes the network configuration (and undoes it on every exit path).
#
#   NP_PER_HOST=2 RATE=2gbit DELAY=100us tests/mpi/two_hosts.sh build/bench/mpi_bench_dispatch --rpn 2
#   HOSTS=3 NP_PER_HOST=2 tests/mpi/two_hosts.sh build/tests/mpi/mpi_tests --gtest_filter='MpiComm.*'
#
# Topology: one network namespace per host (mt_mn_h0 .. mt_mn_h<N-1>, address 198.18.0.<i+1>/24 on its eth0)
# and one "switch" namespace (mt_mn_sw) holding a bridge; each host's eth0 is a veth pair whose other end is
# a bridge port. Nothing is created in the caller's namespace, so the traffic stays inside these namespaces.
# Ranks i*NP_PER_HOST .. (i+1)*NP_PER_HOST-1 run on host i (so ranks_per_node = NP_PER_HOST). Between hosts
# MPI uses TCP; inside a host shared memory (BTL=tcp,vader,self, the default, like a real node) or TCP on the
# host's own stack (BTL=tcp,self).
#
# Environment:
#   HOSTS        number of hosts, 2..16 (default 2)
#   NP_PER_HOST  ranks per host (default 2)
#   RATE         tc rate of each host's link in each direction, e.g. 1gbit, 300mbit (unset: unshaped)
#   DELAY        one-way delay added at each host's egress, e.g. 100us (tc netem; unset: none)
#   BTL          OpenMPI BTL list (default tcp,vader,self)
#   YIELD        1 (default): MCA mpi_yield_when_idle=1, because all hosts share this machine's few cores
#   VETH_STATS   if set, a file that receives one line per host after the run:
#                "host <i> <addr> tx_bytes <n> rx_bytes <n> tx_packets <n> rx_packets <n>" (host side of its
#                veth; the counters start at 0 with the fresh devices, so they cover the whole mpirun)
#   MPIRUN_ARGS  extra arguments for mpirun (word-split)
# The ranks also get MOETRON_HOSTS and MOETRON_RANKS_PER_NODE (= NP_PER_HOST) in their environment.
# The exit status is the program's (mpirun's); 2 for usage errors, 3 when the setup is impossible.
set -euo pipefail
CMD=("$@")
die() { echo "two_hosts.sh: $*" >&2; exit 3; }
[[ ${#CMD[@]} -gt 0 ]] || { echo "usage: [HOSTS=N] [NP_PER_HOST=n] [RATE=r] [DELAY=d] $0 PROGRAM [ARGS...]" >&2; exit 2; }
HOSTS=${HOSTS:-2}
NP_PER_HOST=${NP_PER_HOST:-2}
RATE=${RATE:-}
DELAY=${DELAY:-}
BTL=${BTL:-tcp,vader,self}
YIELD=${YIELD:-1}
VETH_STATS=${VETH_STATS:-}
[[ "$HOSTS" =~ ^[0-9]+$ && $HOSTS -ge 2 && $HOSTS -le 16 ]] || { echo "two_hosts.sh: HOSTS must be 2..16 (got '$HOSTS')" >&2; exit 2; }
[[ "$NP_PER_HOST" =~ ^[0-9]+$ && $NP_PER_HOST -ge 1 ]] || { echo "two_hosts.sh: NP_PER_HOST must be >= 1 (got '$NP_PER_HOST')" >&2; exit 2; }

# Refuse clearly before touching anything.
[[ $(id -u) -eq 0 ]] || die "needs root (it creates network namespaces, veth pairs and tc qdiscs); run it with sudo"
for tool in ip tc mpirun flock; do
  command -v "$tool" >/dev/null || die "'$tool' not found (ip and tc come with iproute2, mpirun with OpenMPI, flock with util-linux)"
done
command -v "${CMD[0]}" >/dev/null || die "program '${CMD[0]}' not found or not executable (build it first)"
CMD[0]=$(realpath "$(command -v "${CMD[0]}")")

# One run at a time on this machine (the namespace names are fixed).
LOCK=/run/lock/moetron_two_hosts.lock
[[ -d /run/lock ]] || LOCK=/tmp/moetron_two_hosts.lock
exec 9>"$LOCK"
flock -w 600 9 || die "another two_hosts.sh run holds $LOCK"

PREFIX=mt_mn
SW=${PREFIX}_sw
NET=198.18.0.0/24
ns_of() { echo "${PREFIX}_h$1"; }
addr_of() { echo "198.18.0.$(($1 + 1))"; }
AGENT=$(mktemp /tmp/mt_mn_rsh_XXXXXX.sh)

remove_namespaces() {
  local ns pids
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}_(h[0-9]+|sw)$" || true); do
    # Processes left in a namespace (an interrupted mpirun and its ranks): end them by pid, then remove it.
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -n "$pids" ]] && kill $pids 2>/dev/null || true
    [[ -n "$pids" ]] && sleep 0.5 && kill -9 $(ip netns pids "$ns" 2>/dev/null) 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
}
MPIRUN_PID=
cleanup() {
  if [[ -n "$MPIRUN_PID" ]] && kill -0 "$MPIRUN_PID" 2>/dev/null; then
    kill -TERM "$MPIRUN_PID" 2>/dev/null || true  # mpirun ends its daemons and ranks
    for _ in $(seq 30); do kill -0 "$MPIRUN_PID" 2>/dev/null || break; sleep 0.1; done
  fi
  remove_namespaces
  rm -f "$AGENT"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
remove_namespaces  # leftovers of a run that was killed with -9

ip netns add "$SW" || die "cannot create network namespaces (kernel without netns, or no CAP_SYS_ADMIN?)"
ip -n "$SW" link add br0 type bridge || die "cannot create a bridge (kernel without bridge support?)"
ip -n "$SW" link set lo up
ip -n "$SW" link set br0 up

# Shaping. A host's eth0 egress is its NIC's transmit side, the bridge port's egress towards the host is its
# receive side: RATE limits both (a full-duplex NIC of RATE), DELAY is added once per direction (host egress).
shape() {  # namespace, device, side (host|port)
  local ns=$1 dev=$2 side=$3
  if [[ -n "$DELAY" && "$side" == host ]]; then
    if [[ -n "$RATE" ]]; then tc -n "$ns" qdisc add dev "$dev" root netem delay "$DELAY" rate "$RATE" limit 100000
    else tc -n "$ns" qdisc add dev "$dev" root netem delay "$DELAY" limit 100000; fi
  elif [[ -n "$RATE" ]]; then
    tc -n "$ns" qdisc add dev "$dev" root tbf rate "$RATE" burst 1mb latency 100ms
  fi
}

for ((i = 0; i < HOSTS; ++i)); do
  ns=$(ns_of $i)
  ip netns add "$ns"
  # Both ends are created directly in their namespaces: nothing appears in the caller's namespace.
  ip link add eth0 netns "$ns" type veth peer name "p$i" netns "$SW"
  ip -n "$ns" addr add "$(addr_of $i)/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$SW" link set "p$i" master br0
  ip -n "$SW" link set "p$i" up
  shape "$ns" eth0 host || die "tc failed on host $i (RATE='$RATE' DELAY='$DELAY'): RATE needs the tbf qdisc, DELAY the netem qdisc (CONFIG_NET_SCH_NETEM), which this kernel may lack"
  shape "$SW" "p$i" port || die "tc failed on the bridge port of host $i"
done

# Wait until every host reaches every other (the bridge ports go through listening/learning first when STP
# is on; it is off here, but the links still need a moment to come up).
for ((i = 1; i < HOSTS; ++i)); do
  ok=0
  for _ in $(seq 50); do
    # A TCP connect to the discard port: "refused" means the host answered (no ping needed).
    out=$(ip netns exec "$(ns_of 0)" timeout 2 bash -c "exec 3<>/dev/tcp/$(addr_of $i)/9" 2>&1 || true)
    if [[ "$out" == *refused* ]]; then ok=1; break; fi
    sleep 0.1
  done
  [[ $ok -eq 1 ]] || die "host 0 cannot reach host $i ($(addr_of $i))"
done

read_stats() {  # -> one line per host
  local i ns d
  for ((i = 0; i < HOSTS; ++i)); do
    ns=$(ns_of $i)
    d=/sys/class/net/eth0/statistics
    echo "host $i $(addr_of $i) $(ip netns exec "$ns" sh -c "echo tx_bytes \$(cat $d/tx_bytes) rx_bytes \$(cat $d/rx_bytes) tx_packets \$(cat $d/tx_packets) rx_packets \$(cat $d/rx_packets)")"
  done
}
# The probes above are in the counters; record them so that the reported figures exclude them.
STATS0=$(read_stats)

# rsh agent for mpirun: $1 is the host (a namespace address), the rest is the command.
{
  echo '#!/bin/sh'
  echo 'host=$1; shift'
  echo 'case "$host" in'
  for ((i = 0; i < HOSTS; ++i)); do echo "  $(addr_of $i)) ns=$(ns_of $i) ;;"; done
  echo '  *) echo "unknown host $host" >&2; exit 1 ;;'
  echo 'esac'
  echo '# A private /dev/shm per host: all hosts have the same host name, so OpenMPI'"'"'s shared-memory segment'
  echo '# names would collide. (ip netns exec runs in its own mount namespace; the tmpfs vanishes with it.)'
  echo 'exec ip netns exec "$ns" /bin/sh -c "mount -t tmpfs -o size=8g mt_mn_shm /dev/shm && $*"'
} > "$AGENT"
chmod +x "$AGENT"

HOSTLIST=""
for ((i = 0; i < HOSTS; ++i)); do HOSTLIST+="${HOSTLIST:+,}$(addr_of $i):$NP_PER_HOST"; done

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MOETRON_HOSTS=$HOSTS MOETRON_RANKS_PER_NODE=$NP_PER_HOST
YIELD_ARGS=()
[[ "$YIELD" == 1 ]] && YIELD_ARGS=(--mca mpi_yield_when_idle 1)
rc=0
# shellcheck disable=SC2086
ip netns exec "$(ns_of 0)" /bin/sh -c 'mount -t tmpfs -o size=8g mt_mn_shm /dev/shm && exec "$@"' sh \
  mpirun --oversubscribe --bind-to none -np $((HOSTS * NP_PER_HOST)) \
  --host "$HOSTLIST" --mca plm_rsh_agent "$AGENT" \
  --mca btl "$BTL" --mca btl_tcp_if_include "$NET" --mca oob_tcp_if_include "$NET" "${YIELD_ARGS[@]}" \
  -x OMP_NUM_THREADS=1 -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
  -x MOETRON_HOSTS -x MOETRON_RANKS_PER_NODE ${MPIRUN_ARGS:-} "${CMD[@]}" <&0 &
# In the background and waited for, so that INT/TERM reach the trap at once (a foreground child would delay it).
MPIRUN_PID=$!
wait "$MPIRUN_PID" || rc=$?
MPIRUN_PID=

STATS1=$(read_stats)
# Counters of the run = after - before (the before figures hold only the reachability probes).
DIFF=$(paste -d' ' <(echo "$STATS0") <(echo "$STATS1") | awk '{
  printf "host %s %s tx_bytes %.0f rx_bytes %.0f tx_packets %.0f rx_packets %.0f\n", $2, $3, $16-$5, $18-$7, $20-$9, $22-$11 }')
echo "$DIFF" | sed 's/^/[two_hosts] veth /' >&2
[[ -n "$VETH_STATS" ]] && echo "$DIFF" > "$VETH_STATS"
exit $rc
