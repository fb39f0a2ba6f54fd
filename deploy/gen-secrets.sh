#!/bin/sh
# gen-secrets.sh DIR [NAMESPACE [CLUSTER_DOMAIN]]: every file deploy/render.py
# secrets --from DIR reads, made with openssl: a CA for etcd and one for
# Baton's services, etcd's server/peer certificate (SANs for every member and
# the client Service), client certificates (CN root for the auth Job, CN baton
# for hooks and anchor), a JWT signing key pair for etcd's auth tokens,
# passwords, a certificate per Baton role (CN = role), and a demo API key.
# For a first install or a test cluster; bring your own PKI for production.
# Writes nothing over an existing DIR.
set -eu
out=${1:?usage: gen-secrets.sh DIR [NAMESPACE [CLUSTER_DOMAIN]]}
namespace=${2:-baton}
domain=${3:-cluster.local}
if [ -e "$out" ]; then
    echo "gen-secrets.sh: $out exists; not overwriting" >&2
    exit 1
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
# The role is the CN and a spiffe://baton/<role> URI SAN (owner and ingress
# certificates name their deployment id too once issued per fleet:
# spiffe://baton/owner/<id>; docs/deploy.md "TLS").
for role in hooks anchor owner ingress; do
    cert "$out/tls" "$out/tls" "$role" "$role" \
        "URI:spiffe://baton/$role,DNS:$role.$svc,DNS:*.$role.$svc" "serverAuth,clientAuth"
done

printf 'demo=%s' "$(openssl rand -hex 16)" >"$out/api-keys"
rm -f "$out/etcd/ca.srl" "$out/tls/ca.srl"
echo "gen-secrets.sh: wrote $out (CA keys included: keep them safe, or delete them)"
