#!/usr/bin/env bash
# Build the real image from ./Dockerfile and run it twice, as one process and with two front
# ends and an engine process: each time ready, one digit classified, metrics scraped, the
# image's HEALTHCHECK passes, and SIGTERM drains to exit status 0.
#
# No Docker engine is needed and no registry is reached: buildah builds and runs the image
# with chroot isolation (as root), on a Debian bookworm + Python 3.11 base made here with
# debootstrap, and the build installs torch and every dependency offline from a wheelhouse
# that the host's pip fills. Cached between runs under $BATCHSERVE_SMOKE_CACHE: the base
# image (in buildah's store), debootstrap's .debs, the wheelhouse and the build's layers.
#
#   deploy/container_smoke.sh          build and run (make container-smoke)
#   deploy/container_smoke.sh --clean  remove the smoke images, the cache and unused layers
#
# Needs: root, buildah and debootstrap (apt-get install buildah debootstrap), a Debian
# mirror in /etc/apt/sources.list* (or DEBIAN_MIRROR), and a Python 3.11 with pip (PYTHON,
# default .venv/bin/python) whose pip finds TORCH_SPEC (default torch==2.13.0).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE_DIR=${BATCHSERVE_SMOKE_CACHE:-/var/cache/batchserve}
# Bump the suffix when the base's recipe below changes, so a stale cached base is not reused.
BASE_IMAGE=localhost/batchserve-smoke-base:bookworm-py311-1
IMAGE=localhost/batchserve:smoke
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-180}
DRAIN_TIMEOUT_S=60
export BUILDAH_ISOLATION=chroot

started_s=$SECONDS
passed=0
say() { printf '[smoke %4ds] %s\n' "$((SECONDS - started_s))" "$*"; }
# One line per check that held; the closing line counts them the way test runners do.
ok() {
    passed=$((passed + 1))
    say "ok: $*"
}
die() {
    say "FAILED: $*" >&2
    echo "container_smoke: $passed passed, 1 failed"
    exit 1
}

if [[ ${1:-} == --clean ]]; then
    buildah containers --noheading --format '{{.ContainerName}}' |
        grep -E '^batchserve-smoke-' | xargs -r buildah rm >/dev/null || true
    buildah rmi "$IMAGE" "$BASE_IMAGE" >/dev/null 2>&1 || true
    # Untagged images are the build's layer cache (buildah cannot tell whose they are).
    buildah rmi --prune >/dev/null 2>&1 || true
    rm -rf "$CACHE_DIR"
    say "removed $IMAGE, $BASE_IMAGE, untagged images and $CACHE_DIR"
    exit 0
fi

[[ $(id -u) == 0 ]] || die "buildah's chroot isolation needs root here; run as root"
for tool in buildah debootstrap ss pgrep flock timeout; do
    command -v "$tool" >/dev/null || die "$tool not found: apt-get install buildah debootstrap"
done
[[ -x $PYTHON ]] || PYTHON=$(command -v python3.11 || true)
[[ -n $PYTHON ]] || die "no Python 3.11 for pip: run make install, or set PYTHON"
# The wheelhouse is filled for the host's interpreter; the image's Python is Debian's 3.11.
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
    die "$PYTHON is not Python 3.11, so its wheels would not fit the image's Python 3.11"

mkdir -p "$CACHE_DIR"
# Two smoke runs at once would share the cache and the image tag: the second one waits.
exec 9>"$CACHE_DIR/lock"
flock -w 1800 9 || die "another container smoke test holds $CACHE_DIR/lock"

work=$(mktemp -d)
container=""
runner_pid=""
cleanup() {
    if [[ -n $runner_pid ]] && kill -0 "$runner_pid" 2>/dev/null; then
        kill -KILL "$runner_pid" 2>/dev/null || true
        server_pid=$(main_pid || listener_pid || true)
        [[ -z $server_pid ]] || kill -KILL "$server_pid" 2>/dev/null || true
    fi
    [[ -z $container ]] || buildah rm "$container" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' TERM INT # so that cleanup runs when timeout(1) or Ctrl-C stops the script

# ---------------------------------------------------------------------------------------------
# 1. The base image: Debian bookworm minbase with Debian's python3 and pip. python3-venv is
#    left out on purpose: the Dockerfile must not need ensurepip, which a base may lack.
if buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    say "base image $BASE_IMAGE: cached"
else
    mirror=${DEBIAN_MIRROR:-$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v '^[[:space:]]*#' |
        grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n 1 | tr -d ' ' || true)}
    mirror=${mirror:-http://deb.debian.org/debian}
    say "base image: debootstrap bookworm from $mirror"
    mkdir -p "$CACHE_DIR/debootstrap-debs"
    rootfs=$work/rootfs
    timeout 600 debootstrap --variant=minbase --include=python3,python3-pip \
        --cache-dir="$CACHE_DIR/debootstrap-debs" bookworm "$rootfs" "$mirror" \
        >"$work/debootstrap.log" 2>&1 || {
        tail -n 30 "$work/debootstrap.log" >&2
        die "debootstrap failed (log above)"
    }
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    base=$(buildah from --pull=never scratch)
    mount=$(buildah mount "$base")
    cp -a "$rootfs"/. "$mount"/
    buildah umount "$base" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /bin/bash "$base"
    buildah commit --quiet --rm "$base" "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    say "base image $BASE_IMAGE: built from $mirror"
fi

# ---------------------------------------------------------------------------------------------
# 2. The wheelhouse: torch, the runtime dependencies and the build backend, as wheels, so the
#    build needs no network. pip skips the files that are already there.
wheelhouse=$CACHE_DIR/wheelhouse
mkdir -p "$wheelhouse"
"$PYTHON" - "$REPO/pyproject.toml" "$TORCH_SPEC" >"$work/requirements.txt" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as file:
    project = tomllib.load(file)
print(sys.argv[2])
print("\n".join(project["build-system"]["requires"] + project["project"]["dependencies"]))
EOF
say "wheelhouse: pip download $(tr '\n' ' ' <"$work/requirements.txt")"
timeout 600 "$PYTHON" -m pip download --only-binary=:all: --dest "$wheelhouse" \
    -r "$work/requirements.txt" >"$work/pip.log" 2>&1 || {
    tail -n 30 "$work/pip.log" >&2
    die "pip download failed (log above)"
}
say "wheelhouse: $(find "$wheelhouse" -name '*.whl' | wc -l) wheels, $(du -sh "$wheelhouse" | cut -f1)"

# ---------------------------------------------------------------------------------------------
# 3. Build the Dockerfile as it is, with the base and the wheelhouse swapped in.
previous_image=$(buildah inspect --type image --format '{{.FromImageID}}' "$IMAGE" 2>/dev/null || true)
say "build: buildah bud (layers cached between runs)"
build_started_s=$SECONDS
timeout 1200 buildah bud --layers --format docker --pull=never \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_SPEC="$TORCH_SPEC" \
    --build-arg PIP_EXTRA_ARGS="--no-index --find-links /wheels" \
    --build-context wheels="$wheelhouse" \
    --tag "$IMAGE" --file "$REPO/Dockerfile" "$REPO" >"$work/build.log" 2>&1 || {
    tail -n 40 "$work/build.log" >&2
    die "buildah bud failed (log above)"
}
grep -E '^torch ' "$work/build.log" | tail -n 1 | sed 's/^/  /' || true
image_id=$(buildah inspect --type image --format '{{.FromImageID}}' "$IMAGE")
ok "built $IMAGE (${image_id:0:12}) in $((SECONDS - build_started_s)) s"
# A rebuilt image leaves the previous one untagged; remove it so the store does not grow.
if [[ -n $previous_image && $previous_image != "$image_id" ]]; then
    buildah rmi "$previous_image" >/dev/null 2>&1 || true
fi

# The image's own user, entrypoint + command and HEALTHCHECK, read back from its config.
buildah inspect --type image "$IMAGE" >"$work/image.json"
config() {
    "$PYTHON" - "$work/image.json" "$1" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))["Docker"]["config"]
print("\n".join({
    "user": [config.get("User") or ""],
    "command": (config.get("Entrypoint") or []) + (config.get("Cmd") or []),
    "healthcheck": (config.get("Healthcheck") or {}).get("Test", [""])[1:],
}[sys.argv[2]]))
EOF
}
user=$(config user)
[[ $user == 10001:10001 ]] || die "image user is '$user', expected 10001:10001"
mapfile -t command < <(config command)
mapfile -t healthcheck < <(config healthcheck)
((${#command[@]} > 0)) || die "the image has neither ENTRYPOINT nor CMD"
((${#healthcheck[@]} > 0)) || die "the image has no HEALTHCHECK"
ok "image config: user $user, command ${command[*]}, a HEALTHCHECK"

# ---------------------------------------------------------------------------------------------
# 4. Run it with its own entrypoint, on a free port of 127.0.0.1 (the host's network): once as
#    one process, once with two front ends and an engine process (BATCHSERVE_WORKERS=2).
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=http://127.0.0.1:$port
listener_pid() { ss -ltnpH "sport = :$port" | grep -oE 'pid=[0-9]+' | head -n 1 | cut -d= -f2; }
# The process the image's command started (the server alone, or the supervisor of the front
# ends and engines): SIGTERM goes to it, as Kubernetes sends it to PID 1. Matched on the
# interpreter too: buildah's chroot runner, which holds the same words, is not the server.
main_pid() { pgrep -o -u 10001 -f '^/opt/batchserve/bin/python[0-9.]* /opt/batchserve/bin/batchserve serve'; }

http() {
    # http METHOD PATH [BODY]: prints "STATUS BODY"; status 0 when nothing answers.
    "$PYTHON" - "$1" "$url$2" "${3:-}" <<'EOF'
import sys, urllib.error, urllib.request
method, url, body = sys.argv[1:]
request = urllib.request.Request(url, method=method, data=body.encode() or None,
                                 headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=10) as answer:
        print(answer.status, answer.read().decode())
except urllib.error.HTTPError as error:
    print(error.code, error.read().decode())
except OSError:
    print(0)
EOF
}

# scikit-learn's digits image 0 (a zero), pixel values / 16.
zero='{"instances": [[
[0,0,0.3125,0.8125,0.5625,0.0625,0,0], [0,0,0.8125,0.9375,0.625,0.9375,0.3125,0],
[0,0.1875,0.9375,0.125,0,0.6875,0.5,0], [0,0.25,0.75,0,0,0.5,0.5,0],
[0,0.3125,0.5,0,0,0.5625,0.5,0], [0,0.25,0.6875,0,0.0625,0.75,0.4375,0],
[0,0.125,0.875,0.3125,0.625,0.75,0,0], [0,0,0.375,0.8125,0.625,0,0,0]]]}'

serve_and_stop() {
    local workers=$1
    container=$(buildah from --pull=never --name "batchserve-smoke-$$-$workers" "$IMAGE")
    say "run (workers=$workers): ${command[*]} on $url"
    # Host network: the container's server listens on the host's loopback only.
    buildah run --network host -e BATCHSERVE_HOST=127.0.0.1 -e BATCHSERVE_PORT="$port" \
        -e BATCHSERVE_DEVICE=cpu -e BATCHSERVE_DRAIN_DELAY_S=3 -e BATCHSERVE_WORKERS="$workers" \
        "$container" -- "${command[@]}" >"$work/server.log" 2>&1 &
    runner_pid=$!

    local deadline_s=$((SECONDS + READY_TIMEOUT_S))
    until [[ $(http GET /readyz) == 200* ]]; do
        kill -0 "$runner_pid" 2>/dev/null || {
            cat "$work/server.log" >&2
            die "the server exited before it was ready (log above)"
        }
        ((SECONDS < deadline_s)) || {
            cat "$work/server.log" >&2
            die "not ready after ${READY_TIMEOUT_S} s (log above)"
        }
        sleep 1
    done
    ok "workers=$workers ready: $(http GET /readyz)"

    server_pid=$(main_pid) || die "no server process found (pgrep)"
    if ((workers == 1)); then
        [[ $server_pid == "$(listener_pid)" ]] || die "pid $server_pid is not the listener"
    fi
    local pid uid
    for pid in $server_pid $(listener_pid); do
        uid=$(awk '/^Uid:/ {print $2}' "/proc/$pid/status")
        [[ $uid == 10001 ]] || die "pid $pid runs as uid $uid, expected 10001"
    done
    ok "workers=$workers: the server (pid $server_pid) and its listener run as uid 10001"

    local answer digit metrics counted
    answer=$(http POST /predict "$zero")
    say "predict: ${answer:0:160}"
    digit=$("$PYTHON" -c 'import json, sys
status, _, body = sys.argv[1].partition(" ")
row = json.loads(body)["predictions"][0] if status == "200" else [None]
print(max(range(len(row)), key=row.__getitem__) if status == "200" else "none")' "$answer")
    [[ $digit == 0 ]] || die "expected the digit 0, got '$digit' from: $answer"
    ok "workers=$workers predict: class $digit"

    metrics=$(http GET /metrics)
    counted=$(grep -E '^batchserve_requests_total\{.*route="/predict".*\} 1\.0$' <<<"${metrics#* }") ||
        die "/metrics does not count the prediction"
    ok "workers=$workers metrics: $counted"

    buildah run --network host -e BATCHSERVE_PORT="$port" "$container" -- "${healthcheck[@]}" ||
        die "the image's HEALTHCHECK command failed against the running server"
    ok "workers=$workers: the image's HEALTHCHECK command passes against the server"

    # 5. SIGTERM: readiness turns 503 while requests are still answered for the drain delay,
    #    then the server drains and exits 0 (a SIGTERM that killed it would give 143). With
    #    front ends the signal reaches them through the supervisor: allow it a moment.
    say "stop: SIGTERM to pid $server_pid"
    kill -TERM "$server_pid"
    local readiness during_drain
    for _ in $(seq 20); do
        readiness=$(http GET /readyz)
        [[ $readiness == 503* ]] && break
        sleep 0.05
    done
    during_drain=$(http POST /predict "$zero")
    [[ $readiness == 503* && $during_drain == 200* ]] || {
        cat "$work/server.log" >&2
        die "after SIGTERM: /readyz '${readiness:0:80}' (expected 503), /predict" \
            "'${during_drain:0:80}' (expected 200 during the drain delay); log above"
    }
    ok "workers=$workers after SIGTERM: /readyz ${readiness:0:40}, /predict still ${during_drain:0:3}"
    local drain_deadline_s=$((SECONDS + DRAIN_TIMEOUT_S)) status=0
    while kill -0 "$runner_pid" 2>/dev/null && ((SECONDS < drain_deadline_s)); do
        sleep 0.2
    done
    kill -0 "$runner_pid" 2>/dev/null && die "still running ${DRAIN_TIMEOUT_S} s after SIGTERM"
    wait "$runner_pid" || status=$?
    runner_pid=""
    [[ $status == 0 ]] || {
        cat "$work/server.log" >&2
        die "the server exited with status $status after SIGTERM, expected 0 (log above)"
    }
    ok "workers=$workers drained and exited 0; last log line: $(tail -n 1 "$work/server.log" | cut -c 1-120)"
    buildah rm "$container" >/dev/null
    container=""
}

# A file of inputs through `batchserve predict` (its engine in a process of its own), as the
# image's user: 100 rows of the zero, each answered as class 0.
predict_a_file() {
    container=$(buildah from --pull=never --name "batchserve-smoke-$$-predict" "$IMAGE")
    local rows=100 lines
    "$PYTHON" -c 'import json, sys
row = json.loads(sys.argv[1])["instances"][0]
sys.stdout.write((json.dumps(row) + "\n") * int(sys.argv[2]))' "$zero" "$rows" >"$work/in.jsonl"
    lines=$(buildah run -e BATCHSERVE_DEVICE=cpu "$container" -- sh -c \
        'cat >/tmp/in.jsonl && batchserve predict --model digits --input /tmp/in.jsonl \
            --output /tmp/out.jsonl >&2 && cat /tmp/out.jsonl' <"$work/in.jsonl" 2>"$work/predict.log") || {
        cat "$work/predict.log" >&2
        die "batchserve predict failed in the image (log above)"
    }
    "$PYTHON" -c 'import json, sys
records = [json.loads(line) for line in sys.argv[1].splitlines()]
classes = {max(range(10), key=r["prediction"].__getitem__) for r in records}
assert [r["row"] for r in records] == list(range(int(sys.argv[2]))), "rows out of order or missing"
assert classes == {0}, f"classes {classes}"' "$lines" "$rows" ||
        die "batchserve predict answered otherwise: ${lines:0:200}"
    ok "predict: $rows rows of a file answered in the image, each class 0; $(tail -n 1 "$work/predict.log" | cut -c 1-100)"
    buildah rm "$container" >/dev/null
    container=""
}

serve_and_stop 1
serve_and_stop 2
predict_a_file
say "PASSED in $((SECONDS - started_s)) s: built, served alone and with front ends, classified a 0, drained on SIGTERM, answered a file"
echo "container_smoke: $passed passed, 0 failed"
