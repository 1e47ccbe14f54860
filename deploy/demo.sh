#!/usr/bin/env bash
# A local demo federation on 127.0.0.1 with Flower's deployment engine, as an operator runs it:
# TLS certificates and SuperNode keys (fedagg certs), a flower-superlink with TLS and
# --enable-supernode-auth, the site keys registered, N flower-supernode processes, then
# `flwr run . demo`. Every process it starts is stopped by PID when it exits (also on Ctrl-C or
# an error). See docs/deployment.md.
#
# Usage (from anywhere; runs from the repository root):
#   deploy/demo.sh                                   # 3 sites, 3 rounds of FedAvg
#   SITES=4 ROUNDS=2 STRATEGY=secure deploy/demo.sh  # secure aggregation
#   STRATEGY=compressed EXTRA='compression.up="topk:0.1+ef+int8"' deploy/demo.sh
#   KEEP=1 deploy/demo.sh                            # keep the work dir (certs, logs)
#
# Outputs: $OUTPUT_DIR/<run>/metrics.json etc. (default runs/ under the repository root).
# Needs: fedagg installed (pip install -e .), Flower 1.42, python3 on PATH.
set -euo pipefail

SITES=${SITES:-3}
ROUNDS=${ROUNDS:-3}
STRATEGY=${STRATEGY:-fedavg}
EXTRA=${EXTRA:-}
KEEP=${KEEP:-0}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUTPUT_DIR=${OUTPUT_DIR:-$ROOT/runs}
WORK=$(mktemp -d -t fedagg-demo.XXXXXX)
PIDS=()

log() { printf '[demo] %s\n' "$*" >&2; }

descendants() {  # all descendants of a PID, deepest first
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        descendants "$child"
        echo "$child"
    done
}

cleanup() {
    local rc=$? pid all=()
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do
        all+=($(descendants "$pid") "$pid")
    done
    if ((${#all[@]})); then
        log "stopping ${#all[@]} processes started by this script (PIDs ${all[*]})"
        kill -TERM "${all[@]}" 2>/dev/null || true
        for _ in $(seq 1 50); do
            local alive=0
            for pid in "${all[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
            ((alive)) || break
            sleep 0.2
        done
        kill -KILL "${all[@]}" 2>/dev/null || true
        wait 2>/dev/null || true
    fi
    if [[ $KEEP == 1 ]]; then
        log "kept $WORK (certificates, private keys, logs)"
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# No packages installed at run time; no usage events sent to Flower Labs and no update check
# at start-up (Flower does both by default; docs/deployment.md, section 1).
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
PORT=$(free_port)
CERTS=$WORK/certs
mkdir -p "$WORK/logs" "$WORK/operator-home"
install -d -m 700 "$WORK/state"   # the SuperLink's database directory (Flower does not create it)
names=$(seq -f "site-%g" 1 "$SITES" | paste -sd, -)

log "1/5 certificates and site keys -> $CERTS"
fedagg certs --out "$CERTS" --san 127.0.0.1 --san localhost --sites "$names" >/dev/null

log "2/5 flower-superlink with TLS and SuperNode authentication on 127.0.0.1:$PORT"
FLWR_HOME=$WORK/superlink-home flower-superlink \
    --ssl-certfile "$CERTS/superlink/server.crt" \
    --ssl-keyfile "$CERTS/superlink/server.key" \
    --ssl-ca-certfile "$CERTS/superlink/ca.crt" \
    --enable-supernode-auth \
    --host 127.0.0.1 --port "$PORT" \
    --database "$WORK/state/superlink.db" \
    --disable-runtime-dependency-installation \
    >"$WORK/logs/superlink.log" 2>&1 &
PIDS+=($!)
python3 - "$PORT" "$CERTS/ca/ca.crt" <<'PY'
import socket, ssl, sys, time
port, ca = int(sys.argv[1]), sys.argv[2]
ctx = ssl.create_default_context(cafile=ca)
for _ in range(240):
    try:
        with socket.create_connection(("127.0.0.1", port), 2) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1"):
            sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit("flower-superlink did not come up over TLS within 120 s")
PY

export FLWR_HOME=$WORK/operator-home
cat >"$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "demo"

[superlink.demo]
address = "127.0.0.1:$PORT"
root-certificates = "$CERTS/ca/ca.crt"
TOML

log "3/5 registering $SITES site keys (flwr supernode register)"
for name in ${names//,/ }; do
    flwr supernode register "$CERTS/sites/$name/auth.pub" demo --name "$name" >/dev/null
done

log "4/5 starting $SITES flower-supernode processes"
i=0
for name in ${names//,/ }; do
    mkdir -p "$WORK/$name-home"
    FLWR_HOME=$WORK/$name-home flower-supernode \
        --superlink "127.0.0.1:$PORT" \
        --root-certificates "$CERTS/sites/$name/ca.crt" \
        --auth-supernode-private-key "$CERTS/sites/$name/auth.key" \
        --port "$(free_port)" \
        --node-config "partition-id=$i num-partitions=$SITES site-name='$name'" \
        >"$WORK/logs/$name.log" 2>&1 &
    PIDS+=($!)
    i=$((i + 1))
done

log "5/5 flwr run . demo: $ROUNDS rounds of '$STRATEGY' (logs: $WORK/logs)"
mkdir -p "$OUTPUT_DIR"
before=$(ls -1 "$OUTPUT_DIR" | sort)
cd "$ROOT"
flwr run . demo --stream --run-config \
    "run.rounds=$ROUNDS run.sites=$SITES run.output_dir=\"$OUTPUT_DIR\" strategy.name=\"$STRATEGY\" $EXTRA"

# The ServerApp writes metrics.json after each round and model.pt at the end.
run_dir=""
for _ in $(seq 1 120); do
    run_dir=$(comm -13 <(echo "$before") <(ls -1 "$OUTPUT_DIR" | sort) | tail -n 1)
    [[ -n $run_dir && -f $OUTPUT_DIR/$run_dir/model.pt ]] && break
    sleep 1
done
[[ -n $run_dir && -f $OUTPUT_DIR/$run_dir/metrics.json ]] || { log "no run output under $OUTPUT_DIR"; exit 1; }
python3 - "$OUTPUT_DIR/$run_dir/metrics.json" <<'PY'
import json, sys
records = json.load(open(sys.argv[1]))
print(f"{'round':>5} {'accuracy':>9} {'seconds':>8} {'exchanges':>9}")
for r in records:
    acc = "-" if r.get("accuracy") is None else f"{r['accuracy']:.4f}"
    print(f"{r['round']:>5} {acc:>9} {r.get('seconds', 0.0):>8.1f} {r.get('exchanges', '-')!s:>9}")
PY
log "outputs: $OUTPUT_DIR/$run_dir"
