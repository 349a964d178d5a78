#!/bin/sh
# Creates (or updates) the ACL user that schedulers of one prefix connect as, with exactly
# the rules `anarchon acl` prints. The password goes to the server as its SHA-256 only,
# and appears on no command line.
#
#   ANARCHON_PREFIX=billing: ACL_USER=billing ACL_PASSWORD='...' \
#   ADMIN_URL=redis://admin@cache.internal:6379 REDISCLI_AUTH='...' sh acl-apply.sh
#
# ADMIN_URL is a user allowed to run ACL SETUSER, without its password: redis-cli reads
# that from REDISCLI_AUTH. REDIS_CLI=valkey-cli for Valkey's client.
set -eu
hash=$(printf '%s' "$ACL_PASSWORD" | sha256sum | cut -d ' ' -f 1)
reply=$(anarchon acl --prefix "$ANARCHON_PREFIX" --user "$ACL_USER" \
    | sed "s/ >PASSWORD / #$hash /" \
    | "${REDIS_CLI:-redis-cli}" -u "$ADMIN_URL")
echo "$reply"
[ "$reply" = OK ]
