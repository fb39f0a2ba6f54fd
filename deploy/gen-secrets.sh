#!/bin/sh
# gen-secrets.sh DIR [NAMESPACE [CLUSTER_DOMAIN]]: every shared file
# deploy/render.py secrets --from DIR reads, made with openssl: a CA for etcd
# and one for Baton's services, etcd's server/peer certificate (SANs for every
# member and the client Service), client certificates (CN root for the auth
# Job, CN baton for hooks and anchor), a JWT signing key pair for etcd's auth
# tokens, passwords, the hooks, anchor and operator certificates (a
# spiffe://baton/<role> URI SAN each), and a demo API key. Writes nothing over
# an existing DIR.
#
# gen-secrets.sh fleet DIR DEPLOYMENT_ID [NAMESPACE [CLUSTER_DOMAIN]]: the
# owner and ingress certificates of one deployment id (spiffe://baton/owner/ID,
# spiffe://baton/ingress/ID), signed by DIR's services CA; run it for every new
# deployment id. Extra names for the ingress certificate (the public name
# gateways dial): BATON_PUBLIC_NAMES="DNS:api.example.com,IP:203.0.113.7".
#
# For a first install or a test cluster; bring your own PKI for production
# (the same file names; render.py lists them in SECRETS and fleet_secrets).
set -eu
usage="usage: gen-secrets.sh DIR [NAMESPACE [CLUSTER_DOMAIN]] | gen-secrets.sh fleet DIR DEPLOYMENT_ID [NAMESPACE [CLUSTER_DOMAIN]]"
mode=shared
if [ "${1:-}" = fleet ]; then
    mode=fleet
    shift
    out=${1:?$usage}
    deployment=${2:?$usage}
    shift
else
    out=${1:?$usage}
fi
namespace=${2:-baton}
domain=${3:-cluster.local}
if [ "$mode" = shared ] && [ -e "$out" ]; then
    echo "gen-secrets.sh: $out exists; not overwriting" >&2
    exit 1
fi
if [ "$mode" = fleet ]; then
    if [ ! -f "$out/tls/ca.key" ]; then
        echo "gen-secrets.sh: $out/tls/ca.key not found (run gen-secrets.sh $out first)" >&2
        exit 1
    fi
    if [ -e "$out/tls/owner-$deployment.crt" ]; then
        echo "gen-secrets.sh: certificates of $deployment exist in $out; not overwriting" >&2
        exit 1
    fi
fi
umask 077
mkdir -p "$out/etcd" "$out/tls"
days=825

ca() { # dir name
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -subj "/CN=$2" \
        -keyout "$1/ca.key" -out "$1/ca.crt" 2>/dev/null
}
cert() { # dir ca-dir file-stem CN SANs(comma-separated DNS/IP entries or "") usage
    ext=$(mktemp)
    {
        echo "basicConstraints=CA:FALSE"
        echo "keyUsage=digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$6"
        if [ -n "$5" ]; then echo "subjectAltName=$5"; fi
    } >"$ext"
    openssl req -new -newkey rsa:2048 -nodes -sha256 -subj "/CN=$4" \
        -keyout "$1/$3.key" -out "$1/$3.csr" 2>/dev/null
    openssl x509 -req -sha256 -days "$days" -in "$1/$3.csr" -CA "$2/ca.crt" \
        -CAkey "$2/ca.key" -CAcreateserial -extfile "$ext" -out "$1/$3.crt" 2>/dev/null
    rm -f "$1/$3.csr" "$ext"
}
password() {
    openssl rand -hex 24 | tr -d '\n'
}

svc="$namespace.svc.$domain"
if [ "$mode" = fleet ]; then
    # The owner certificate names the deployment id; DNS:owner.$svc is the
    # name other owners verify it by when they dial its pod IP
    # (BATON_TLS_IP_SERVER_NAME); owner-<id> is its fleet's Service.
    cert "$out/tls" "$out/tls" "owner-$deployment" "owner-$deployment" \
        "URI:spiffe://baton/owner/$deployment,DNS:owner.$svc,DNS:owner-$deployment.$svc,DNS:*.owner-$deployment.$svc" \
        "serverAuth,clientAuth"
    # The ingress certificate: its fleet's Service, the public entry, and any
    # public names given.
    public=${BATON_PUBLIC_NAMES:+,$BATON_PUBLIC_NAMES}
    cert "$out/tls" "$out/tls" "ingress-$deployment" "ingress-$deployment" \
        "URI:spiffe://baton/ingress/$deployment,DNS:ingress-$deployment.$svc,DNS:*.ingress-$deployment.$svc,DNS:baton-public.$svc$public" \
        "serverAuth,clientAuth"
    rm -f "$out/tls/ca.srl"
    echo "gen-secrets.sh: wrote the owner and ingress certificates of $deployment to $out/tls"
    exit 0
fi

ca "$out/etcd" "baton etcd CA"
cert "$out/etcd" "$out/etcd" server etcd \
    "DNS:*.etcd.$svc,DNS:etcd.$svc,DNS:etcd-client.$svc,DNS:*.etcd-client.$svc,DNS:localhost,IP:127.0.0.1" \
    "serverAuth,clientAuth"
cert "$out/etcd" "$out/etcd" root-client root "" clientAuth
cert "$out/etcd" "$out/etcd" baton-client baton "" clientAuth
openssl genrsa -out "$out/etcd/jwt.key" 2048 2>/dev/null
openssl rsa -in "$out/etcd/jwt.key" -pubout -out "$out/etcd/jwt.pub" 2>/dev/null
password >"$out/etcd/root-password"
password >"$out/etcd/baton-password"

ca "$out/tls" "baton services CA"
# The role is the CN and a spiffe://baton/<role> URI SAN (docs/security.md);
# owner and ingress certificates are per deployment id (mode fleet).
for role in hooks anchor; do
    cert "$out/tls" "$out/tls" "$role" "$role" \
        "URI:spiffe://baton/$role,DNS:$role.$svc,DNS:*.$role.$svc" "serverAuth,clientAuth"
done
# The operator's (the drain Job, grpcurl): a client certificate only.
cert "$out/tls" "$out/tls" operator operator "URI:spiffe://baton/operator" clientAuth

# A channel API key (clear here: ingress hashes it when it reads the file;
# `baton hash-key CHANNEL` prints the line that grants a key as its hash).
printf 'demo=%s\n' "$(openssl rand -hex 16)" >"$out/api-keys"
rm -f "$out/etcd/ca.srl" "$out/tls/ca.srl"
echo "gen-secrets.sh: wrote $out (CA keys included: keep them safe, or delete them)"
