#!/bin/bash
# two_hosts.sh: run an MPI program on two emulated "hosts" of this machine, so that the inter-node link is a
# real network link (a veth pair between two network namespaces, optionally slowed with tc) and not shared
# memory. Used for the hierarchical-dispatch figures in docs/parallel.md. Needs root and iproute2.
# Not a test that CTest runs: it changes the network configuration (and undoes it on exit, even on failure).
#
#   NP_PER_HOST=2 RATE=2gbit DELAY=100us tests/mpi/two_hosts.sh build/bench/mpi_bench_dispatch --rpn 2
#
# Ranks 0..NP_PER_HOST-1 run on host A, the others on host B (ranks_per_node = NP_PER_HOST). Between hosts MPI
# uses TCP over the veth link. Inside a host: shared memory (BTL=tcp,vader,self, the default, like a real
# node) or TCP on that host's own stack (BTL=tcp,self).
# RATE (tc tbf) and DELAY (tc netem) shape each direction of the veth link; unset = unshaped.
# Addresses come from the benchmarking range 198.18.0.0/15 and traffic stays between the two namespaces.
set -euo pipefail
CMD=("$@")
[[ ${#CMD[@]} -gt 0 ]] || { echo "usage: $0 PROGRAM [ARGS...]" >&2; exit 2; }
NP_PER_HOST=${NP_PER_HOST:-2}
RATE=${RATE:-}
BTL=${BTL:-tcp,vader,self}
DELAY=${DELAY:-}
NS_A=mt_comm_host_a
NS_B=mt_comm_host_b
ADDR_A=198.18.0.1
ADDR_B=198.18.0.2
NET=198.18.0.0/24
AGENT=$(mktemp /tmp/mt_comm_rsh_XXXXXX.sh)

cleanup() {
  ip netns del "$NS_A" 2>/dev/null || true
  ip netns del "$NS_B" 2>/dev/null || true
  rm -f "$AGENT"
}
trap cleanup EXIT INT TERM
cleanup_first() { ip netns del "$NS_A" 2>/dev/null || true; ip netns del "$NS_B" 2>/dev/null || true; }
cleanup_first

ip netns add "$NS_A"
ip netns add "$NS_B"
ip link add mt_comm_va type veth peer name mt_comm_vb
ip link set mt_comm_va netns "$NS_A"
ip link set mt_comm_vb netns "$NS_B"
ip -n "$NS_A" addr add "$ADDR_A/24" dev mt_comm_va
ip -n "$NS_B" addr add "$ADDR_B/24" dev mt_comm_vb
for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
ip -n "$NS_A" link set mt_comm_va up
ip -n "$NS_B" link set mt_comm_vb up
shape() {  # namespace, device
  if [[ -n "$DELAY" && -n "$RATE" ]]; then
    tc -n "$1" qdisc add dev "$2" root netem delay "$DELAY" rate "$RATE" limit 100000
  elif [[ -n "$DELAY" ]]; then
    tc -n "$1" qdisc add dev "$2" root netem delay "$DELAY" limit 100000
  elif [[ -n "$RATE" ]]; then
    tc -n "$1" qdisc add dev "$2" root tbf rate "$RATE" burst 1mb latency 100ms
  fi
}
shape "$NS_A" mt_comm_va
shape "$NS_B" mt_comm_vb

cat > "$AGENT" <<AGENT_EOF
#!/bin/sh
# rsh agent for mpirun: \$1 is the host (a namespace address), the rest is the command.
host=\$1; shift
case "\$host" in
  $ADDR_A) ns=$NS_A ;;
  $ADDR_B) ns=$NS_B ;;
  *) echo "unknown host \$host" >&2; exit 1 ;;
esac
# A private /dev/shm per host: both hosts have the same host name, so OpenMPI's shared-memory segment names
# would collide. (ip netns exec runs in its own mount namespace; the tmpfs vanishes with it.)
exec ip netns exec "\$ns" /bin/sh -c "mount -t tmpfs -o size=8g mt_comm_shm /dev/shm && \$*"
AGENT_EOF
chmod +x "$AGENT"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ip netns exec "$NS_A" /bin/sh -c 'mount -t tmpfs -o size=8g mt_comm_shm /dev/shm && exec "$@"' sh mpirun --oversubscribe --bind-to none -np $((2 * NP_PER_HOST)) \
  --host "$ADDR_A:$NP_PER_HOST,$ADDR_B:$NP_PER_HOST" --mca plm_rsh_agent "$AGENT" \
  --mca btl "$BTL" --mca btl_tcp_if_include "$NET" --mca oob_tcp_if_include "$NET" \
  -x OMP_NUM_THREADS=1 -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM "${CMD[@]}"
