#!/usr/bin/env bash
# A throwaway Slurm cluster with accounting, for the `slurm` tests (tests/integration/test_slurm_real.py):
# this host as one node, plus (where network/UTS/mount namespaces work) two more nodes on the
# same machine, each a slurmd in its own namespaces, for the two-node tests.
#
#   bash .ci/slurm_cluster.sh start    # install Debian's packages if missing (root), start munged,
#                                      # MariaDB, slurmdbd, slurmctld, slurmd; print `export SLURM_CONF=...`
#   bash .ci/slurm_cluster.sh env      # the `export SLURM_CONF=...` line again
#   bash .ci/slurm_cluster.sh status   # daemons, sinfo, squeue
#   bash .ci/slurm_cluster.sh stop     # cancel jobs, stop every daemon this script started (by PID)
#
# Partition `cpu` (default): this host (`hostname -s`) as one node. Partition `two`: nodes zr-n1 and
# zr-n2, two slurmd each in its own network, UTS and mount namespace (own hostname, own /dev/shm,
# own /etc/hosts naming the nodes), with an address on a bridge this script creates
# ($ZR_SLURM_NET.11 / .12; the bridge zrbr0 holds $ZR_SLURM_NET.1, where slurmctld is reached):
# what two hosts look like to the runtime (the shared-memory transport sees no peer segment across
# them), with traffic only on addresses made here (no default route, no forwarding). Files (/tmp,
# the repository) stay shared, as on a cluster's shared filesystem. $ZR_SLURM_NODES2: auto
# [default] (the two-node part is skipped with a warning where namespaces cannot be made), 1
# (required: start fails without it), 0 (off). Why it is missing is in $ZR_SLURM_DIR/two_nodes.
# One node (this host) is always there; slurmdbd + a
# private MariaDB so that `sacct` works (submitit polls it; without accounting a job whose process was
# hard-killed is never seen to end). Everything lives in one folder, $ZR_SLURM_DIR
# [${TMPDIR:-/tmp}/zr-slurm-ci-<uid>, made 0700 afresh: never through a name someone else placed],
# wiped on every start: job ids and the accounting database start fresh,
# so an old job never answers for a new one. Nothing is written to /etc; clients find the cluster
# through SLURM_CONF, which sbatch/srun export into jobs.
#
# Facts this relies on (Debian 12, Slurm 22.05):
# - no cgroups/systemd here: proctrack/linuxproc + task/none; SlurmUser=root.
# - with accounting, auth must be munge, and sacct/sacctmgr only talk to munged on its default socket
#   /run/munge/munge.socket.2 (AuthInfo=socket= is ignored there): munged runs there with our own key
#   (a munged already answering on that socket is used as it is).
# - the node may advertise more CPUs than exist (SlurmdParameters=config_overrides): $ZR_SLURM_CPUS
#   [4] lets two 2-rank jobs run side by side on a 2-core machine.
# - slurmd takes its node name from the hostname (the UTS namespace's); %n in SlurmdSpoolDir /
#   SlurmdPidFile / SlurmdLogFile keeps the three slurmd's files apart.
# - munge is a unix socket on the filesystem: the namespaced slurmd reach the host's munged.
# Ports: $ZR_SLURM_PORT_BASE [6817]: slurmctld, +1 slurmd, +2 slurmdbd, +3 MariaDB.
set -euo pipefail

DIR=${ZR_SLURM_DIR:-${TMPDIR:-/tmp}/zr-slurm-ci-$(id -u)}
CPUS=${ZR_SLURM_CPUS:-4}
PORT=${ZR_SLURM_PORT_BASE:-6817}
NODE=$(hostname -s)
CONF=$DIR/etc/slurm.conf
MUNGE_SOCKET=/run/munge/munge.socket.2
NODES2=${ZR_SLURM_NODES2:-auto}
NET=${ZR_SLURM_NET:-10.213.0}     # the two namespaced nodes' /24 (addresses made here only)
BRIDGE=zrbr0
NS_NODES=(zr-n1 zr-n2)
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd slurmd-zr-n1 slurmd-zr-n2)  # stop in reverse
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)

say() { echo "[slurm_cluster] $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

pid_of() { cat "$DIR/run/$1.pid" 2>/dev/null || true; }
running() { local p; p=$(pid_of "$1"); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

# launch NAME CMD...: CMD in the background (no stdin), its PID in run/NAME.pid
launch() {
  local name=$1; shift
  nohup "$@" >"$DIR/log/$name.out" 2>&1 </dev/null &
  echo $! >"$DIR/run/$name.pid"
}

# await SECONDS WHAT CMD...: poll CMD every 0.25 s; on timeout show the logs and fail
await() {
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$end" ]; then
      say "no $what after ${limit}s; last log lines:"
      tail -n 15 "$DIR"/log/* >&2 || true
      return 1
    fi
    sleep 0.25
  done
}

install_packages() {
  dpkg -s "${PACKAGES[@]}" >/dev/null 2>&1 && return 0
  [ "$(id -u)" = 0 ] || die "Slurm packages missing and not root: apt-get install ${PACKAGES[*]}"
  say "installing ${PACKAGES[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # the postinst scripts do not start services here (no systemd / policy-rc.d): we start our own
  apt-get update -qq
  local log
  log=$(mktemp)
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >"$log" 2>&1 ||
    { tail -n 20 "$log" >&2; rm -f "$log"; die "apt-get install failed"; }
  rm -f "$log"
}

write_config() {
  local mem override="" ctld_addr=127.0.0.1
  mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  mem=$(( mem > 2048 ? mem - 1024 : mem ))  # leave the OS some room, or the node drains
  [ "$CPUS" -le "$(nproc)" ] || override="SlurmdParameters=config_overrides"
  two_nodes_on && ctld_addr=$NET.1  # the namespaced slurmd reach the controller on the bridge
  cat >"$CONF" <<EOF
# written by .ci/slurm_cluster.sh: this host as node $NODE (partition cpu), and where namespaces
# work the namespaced nodes ${NS_NODES[*]} (partition two); CPU only, accounting through slurmdbd
ClusterName=zrci
SlurmctldHost=$NODE($ctld_addr)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pidfile
SlurmdPidFile=$DIR/run/slurmd-%n.pidfile
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
InactiveLimit=0
KillWait=5
MinJobAge=300
$override
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
PartitionName=cpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  if two_nodes_on; then
    local i
    for i in "${!NS_NODES[@]}"; do
      echo "NodeName=${NS_NODES[$i]} NodeAddr=$NET.$((11 + i)) CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=$((mem / 4)) State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=two Nodes=$(IFS=,; echo "${NS_NODES[*]}") MaxTime=INFINITE State=UP" >>"$CONF"
  fi
  # slurmdbd reads slurmdbd.conf from the folder of SLURM_CONF and refuses a readable one
  cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=$NODE
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pidfile
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 3))
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"
}

# ------------------------------------------------------------ the two namespaced nodes
two_nodes_on() { [ -f "$DIR/two_nodes" ] && [ "$(head -n 1 "$DIR/two_nodes")" = up ]; }

net_teardown() {  # only what this script names: the namespaces zr-n*, the bridge zrbr0
  local n
  for n in "${NS_NODES[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  ip link del "$BRIDGE" 2>/dev/null || true
}

# net_setup: the bridge ($NET.1) and one network namespace per node with a veth on it
# ($NET.11, .12; no default route: nothing leaves the /24); the nodes' /etc/hosts
net_setup() {
  local i n
  command -v ip >/dev/null || { echo "no 'ip' command (iproute2)"; return 1; }
  { ip link add "$BRIDGE" type bridge && ip addr add "$NET.1/24" dev "$BRIDGE" &&
    ip link set "$BRIDGE" up; } || { echo "cannot create the bridge $BRIDGE"; return 1; }
  for i in "${!NS_NODES[@]}"; do
    n=${NS_NODES[$i]}
    ip netns add "$n" || { echo "cannot create network namespace $n (ip netns add)"; return 1; }
    { ip link add "zrv$((i + 1))" type veth peer name eth0 netns "$n" &&
      ip link set "zrv$((i + 1))" master "$BRIDGE" up &&
      ip -n "$n" addr add "$NET.$((11 + i))/24" dev eth0 &&
      ip -n "$n" link set eth0 up && ip -n "$n" link set lo up; } ||
      { echo "cannot wire $n to $BRIDGE (veth)"; return 1; }
  done
  nsenter --net="/run/netns/${NS_NODES[0]}" unshare --mount --uts --propagation private true ||
    { echo "cannot create mount/UTS namespaces (unshare)"; return 1; }
  { echo "127.0.0.1 localhost"; echo "$NET.1 $NODE"
    for i in "${!NS_NODES[@]}"; do echo "$NET.$((11 + i)) ${NS_NODES[$i]}"; done
  } >"$DIR/etc/hosts"
}

# two_nodes_prepare: decide before the config is written; $DIR/two_nodes says "up" or "off: why"
two_nodes_prepare() {
  local why
  net_teardown
  if [ "$NODES2" = 0 ]; then echo "off: ZR_SLURM_NODES2=0" >"$DIR/two_nodes"; return; fi
  if [ "$(id -u)" != 0 ]; then
    why="not root: network namespaces need it"
  elif ! why=$(net_setup 2>&1); then
    why=$(echo "$why" | tail -n 1)
  else
    echo up >"$DIR/two_nodes"; return
  fi
  net_teardown
  echo "off: $why" >"$DIR/two_nodes"
  [ "$NODES2" = 1 ] && die "two namespaced nodes required (ZR_SLURM_NODES2=1) but: $why"
  say "WARNING: no two-node partition ($why): the two-node tests will be skipped"
}

# launch_node NAME: its slurmd in its network namespace, with its own hostname (UTS), /dev/shm
# and /etc/hosts (mount namespace); slurmd takes its node name from the hostname
launch_node() {
  local n=$1
  # (nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs the host's /sys/fs/cgroup)
  launch "slurmd-$n" nsenter --net="/run/netns/$n" unshare --mount --uts --propagation private \
    bash -c "hostname $n && mount -t tmpfs -o mode=1777 tmpfs /dev/shm &&
             mount --bind '$DIR/etc/hosts' /etc/hosts && exec slurmd -D -f '$CONF'"
}

two_up() { [ "$(sinfo -h -N -p two -o %T | grep -Ec '^(idle|mixed|allocated)')" = "${#NS_NODES[@]}" ]; }

munge_ok() { munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET"; }

start_munged() {
  if munge_ok >/dev/null 2>&1; then say "munged already serves $MUNGE_SOCKET: using it"; return; fi
  mkdir -p /run/munge && chmod 755 /run/munge
  mungekey --create --keyfile="$DIR/munge/munge.key" && chmod 600 "$DIR/munge/munge.key"
  launch munged munged --foreground --force --socket="$MUNGE_SOCKET" \
    --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
    --seed-file="$DIR/munge/seed" --log-file="$DIR/log/munged.log"
  await 15 munged munge_ok
}

sql() { mariadb -S "$DIR/run/mysql.sock" -e "$1"; }

start_database() {
  mariadb-install-db --user=root --datadir="$DIR/mysql" --auth-root-authentication-method=socket \
    --skip-test-db >"$DIR/log/mariadb-install-db.log" 2>&1 || die "mariadb-install-db failed (log/)"
  launch mariadbd mariadbd --user=root --datadir="$DIR/mysql" --socket="$DIR/run/mysql.sock" \
    --port=$((PORT + 3)) --bind-address=127.0.0.1 --pid-file="$DIR/run/mariadbd.pidfile" \
    --log-error="$DIR/log/mariadbd.err" --skip-log-bin --innodb-buffer-pool-size=128M
  await 60 MariaDB sql "select 1"
  sql "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
       CREATE USER 'slurm'@'localhost' IDENTIFIED BY 'slurm';
       GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
       GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  launch slurmdbd slurmdbd -D -s
  await 60 slurmdbd sacctmgr -n show cluster
  sacctmgr -i add cluster zrci >/dev/null
}

node_up() { sinfo -h -n "$NODE" -o %T | grep -Eq '^(idle|mixed|allocated)'; }

do_start() {
  local t0=$SECONDS d
  for d in "${DAEMONS[@]}"; do
    if running "$d"; then say "a cluster from $DIR is still running: stopping it first"; do_stop; break; fi
  done
  install_packages
  rm -rf "$DIR"
  mkdir -p "$(dirname "$DIR")"
  # made here, private (a name someone else placed meanwhile fails, and is never followed)
  mkdir -m 700 "$DIR" || die "$DIR could not be made afresh (someone else's?): set ZR_SLURM_DIR"
  mkdir -p "$DIR"/{etc,state,spool,log,run,munge,mysql} "$DIR/spool/$NODE" "${NS_NODES[@]/#/$DIR/spool/}"
  chmod 700 "$DIR/munge"
  export SLURM_CONF=$CONF
  two_nodes_prepare
  write_config
  start_munged
  start_database
  launch slurmctld slurmctld -D -f "$CONF"
  launch slurmd slurmd -D -f "$CONF"
  await 60 "node $NODE up" node_up || { sinfo -R >&2 || true; die "cluster did not come up"; }
  if two_nodes_on; then
    for d in "${NS_NODES[@]}"; do launch_node "$d"; done
    if ! await 60 "nodes ${NS_NODES[*]} up" two_up; then
      sinfo -R >&2 || true
      echo "off: the namespaced slurmd did not come up (log/slurmd-zr-n*.log)" >"$DIR/two_nodes"
      [ "$NODES2" = 1 ] && die "two namespaced nodes required (ZR_SLURM_NODES2=1) but they did not come up"
      say "WARNING: the namespaced nodes did not come up: the two-node tests will be skipped"
    fi
  fi
  say "up in $((SECONDS - t0)) s: $(sinfo -h -o '%P %D %T %N %c CPUs' | tr '\n' ';')"
  do_env
}

do_env() { echo "export SLURM_CONF=$CONF"; }

do_stop() {
  export SLURM_CONF=$CONF
  local i d p
  if running slurmctld; then
    # jobs first: slurmstepd detaches from slurmd and would outlive the daemons
    scancel --quiet --user="$(id -un)" 2>/dev/null || true
    for i in $(seq 1 40); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.25; done
  fi
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    d=${DAEMONS[$i]}
    running "$d" || continue
    p=$(pid_of "$d")
    kill "$p" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$p" 2>/dev/null || break; sleep 0.25; done
    if kill -0 "$p" 2>/dev/null; then say "$d ($p) ignored SIGTERM: SIGKILL"; kill -9 "$p" 2>/dev/null || true; fi
    say "stopped $d ($p)"
    rm -f "$DIR/run/$d.pid"
  done
  net_teardown
}

do_status() {
  export SLURM_CONF=$CONF
  local d
  for d in "${DAEMONS[@]}"; do
    if running "$d"; then echo "$d: running (pid $(pid_of "$d"))"; else echo "$d: not running"; fi
  done
  [ -f "$DIR/two_nodes" ] && echo "two-node partition: $(head -n 1 "$DIR/two_nodes")"
  if running slurmctld; then sinfo; squeue; fi
}

case "${1:-}" in
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  env) do_env ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
