#!/bin/sh
# Make the certificates a mutual-TLS stablewatch deployment needs, with openssl (1.1.1 or later).
#
#   deploy/tls/make-certs.sh CA_DIR OUT_DIR [AGENT_ID ...]
#
# CA_DIR keeps the CA's private key (ca-key.pem): keep it apart from the services, it can issue
# any identity. OUT_DIR receives what the services mount (PEM, EC P-256):
#
#   ca.pem                             the CA certificate everyone trusts
#   detector.pem, detector-key.pem     the detectors (both replicas): DNS detector, detector-0,
#                                      detector-1, stablewatch-detector, localhost, IP 127.0.0.1
#                                      (server and client use: their own health probes)
#   prometheus.pem, prometheus-key.pem Prometheus scraping /metrics (no role: /metrics only)
#   operator.pem, operator-key.pem     URI stablewatch://role/operator: read and trigger snapshots
#   reader.pem, reader-key.pem         URI stablewatch://role/reader: read only
#   agent-ID.pem, agent-ID-key.pem     one per AGENT_ID: URI stablewatch://process/ID, DNS ID,
#                                      localhost, IP 127.0.0.1 (server and client use); so
#                                      agents should check stablewatch-detector in their detector's
#                                      certificate (TlsConfig.detector_name), a name no agent's has
#
# Files that exist are kept, so the script can run again to add agents. Run as root (as the
# compose file's one-shot `certs` service does), it hands each key to the user of the container
# that reads it: DETECTOR_UID (10001: detector, operator, reader) and PROMETHEUS_UID (65534).
# Agent ids must be made of letters, digits and . _ ~ - (the URI then needs no escaping).
set -eu

DAYS="${DAYS:-825}"
DETECTOR_UID="${DETECTOR_UID:-10001}"
PROMETHEUS_UID="${PROMETHEUS_UID:-65534}"

if [ "$#" -lt 2 ]; then
    echo "usage: $0 CA_DIR OUT_DIR [AGENT_ID ...]" >&2
    exit 2
fi
ca_dir="$1"
out="$2"
shift 2
for id in "$@"; do
    case "$id" in
        "" | *[!A-Za-z0-9._~-]*)
            echo "$0: agent id '$id' may only hold letters, digits and . _ ~ -" >&2
            exit 2
            ;;
        detector | detector-0 | detector-1 | stablewatch-detector | localhost)
            # An agent's certificate naming a detector's DNS name could serve as the detector.
            echo "$0: agent id '$id' is a name of the detectors' certificate; choose another" >&2
            exit 2
            ;;
    esac
done
mkdir -p "$ca_dir" "$out"
umask 077
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ ! -f "$ca_dir/ca-key.pem" ]; then
    if [ -f "$out/ca.pem" ]; then
        echo "$0: $out/ca.pem exists but its key $ca_dir/ca-key.pem does not; remove $out to start over" >&2
        exit 1
    fi
    openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 -days 3650 \
        -subj "/CN=stablewatch CA" -keyout "$ca_dir/ca-key.pem" -out "$ca_dir/ca.pem" \
        -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    echo "made the CA: $ca_dir/ca.pem"
fi
cp "$ca_dir/ca.pem" "$out/ca.pem"
chmod 0644 "$out/ca.pem"

# leaf NAME COMMON_NAME EXTENDED_KEY_USAGE SUBJECT_ALT_NAMES OWNER_UID
leaf() {
    name="$1"
    if [ -f "$out/$name.pem" ] && [ -f "$out/$name-key.pem" ]; then
        return
    fi
    cat >"$work/$name.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=$3
subjectAltName=$4
EOF
    openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -subj "/CN=$2" \
        -keyout "$out/$name-key.pem" -out "$work/$name.csr" 2>/dev/null
    openssl x509 -req -sha256 -days "$DAYS" -in "$work/$name.csr" -CA "$ca_dir/ca.pem" \
        -CAkey "$ca_dir/ca-key.pem" -set_serial "0x$(openssl rand -hex 16)" \
        -extfile "$work/$name.ext" -out "$out/$name.pem" 2>/dev/null
    chmod 0644 "$out/$name.pem"
    chmod 0600 "$out/$name-key.pem"
    if [ "$(id -u)" = 0 ]; then
        chown "$5" "$out/$name.pem" "$out/$name-key.pem"
    fi
    echo "made $out/$name.pem"
}

leaf detector "stablewatch detector" serverAuth,clientAuth \
    "DNS:detector,DNS:detector-0,DNS:detector-1,DNS:stablewatch-detector,DNS:localhost,IP:127.0.0.1" "$DETECTOR_UID"
leaf prometheus "prometheus" clientAuth "DNS:prometheus" "$PROMETHEUS_UID"
leaf operator "stablewatch operator" clientAuth "URI:stablewatch://role/operator" "$DETECTOR_UID"
leaf reader "stablewatch reader" clientAuth "URI:stablewatch://role/reader" "$DETECTOR_UID"
for id in "$@"; do
    leaf "agent-$id" "$id" serverAuth,clientAuth \
        "URI:stablewatch://process/$id,DNS:$id,DNS:localhost,IP:127.0.0.1" "$DETECTOR_UID"
done
