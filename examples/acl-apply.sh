#!/bin/sh
# Creates (or updates) the ACL user that schedulers of one prefix connect as, with exactly
# the rules `anarchon acl` prints. The password goes to the server as its SHA-256 only,
# and appears on no command line.
#
#   read -rs ACL_PASSWORD && read -rs REDISCLI_AUTH && export ACL_PASSWORD REDISCLI_AUTH
#   ANARCHON_PREFIX=billing: ACL_USER=billing ADMIN_URL=redis://admin@cache.internal:6379 \
#     sh acl-apply.sh
#
# (read -s takes the two passwords without echoing them, and keeps them out of the
# shell's history and off every command line.)
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
