-- The hash a tenant's shuffle-set draws come from: sha256 of its UTF-8 bytes, in hex. The
-- generated route and verify code (qm.route_source, qm.rule_member) compute it inline.
CREATE OR REPLACE FUNCTION qm.draw_hex(tenant text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN encode(sha256(convert_to(tenant, 'UTF8')), 'hex');
