// The frames this client sends and reads, checked against docs/protocol.schema.json (ajv).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { Ajv2020 } from "ajv/dist/2020.js";
import { type ClientFrame, encode, parseServer, ServerFrameError } from "../src/frames.js";

const schemaPath = new URL("../../../../docs/protocol.schema.json", import.meta.url);
const schema = JSON.parse(readFileSync(schemaPath, "utf8")) as { $defs: Record<string, unknown> };
const ajv = new Ajv2020({ allErrors: true, strict: false });
ajv.addSchema(schema, "qm");

function valid(definition: string, text: string): void {
  const check = ajv.getSchema(`qm#/$defs/${definition}`);
  assert.ok(check, `no definition ${definition}`);
  // the schema's integers are checked as numbers: bigints are written as integers, read back as numbers
  const ok = check(JSON.parse(text));
  assert.ok(ok, `${text} does not match ${definition}: ${ajv.errorsText(check.errors)}`);
}

const clientFrames: ClientFrame[] = [
  { type: "subscribe", queue: "orders", credit: 10, ref: "subscribe" },
  { type: "subscribe", queue: "orders", tenants: ["acme", "Zürich"] },
  { type: "credit", credit: 0, ref: 7 },
  { type: "ack", events: [[1041, 1], [9223372036854775807n, 2147483647]], ref: 12 },
  { type: "nack", events: [{ id: 1043, attempt: 1, delay: 30, error: 'upstream "503"' }, { id: 1044n, attempt: 2 }] },
  { type: "extend", events: [{ id: 1044, attempt: 1, seconds: 300 }], ref: "x" },
  { type: "ping", ref: "p1" },
];

test("every client frame this receiver sends matches the schema", () => {
  for (const frame of clientFrames) {
    valid(frame.type, encode(frame));
    valid("client_frame", encode(frame));
  }
  assert.deepEqual(new Set(clientFrames.map((f) => f.type)).size, 6);
});

test("ids above 2^53 are written and read exactly", () => {
  const text = encode({ type: "ack", events: [[9223372036854775807n, 1]] });
  assert.equal(text, '{"type":"ack","events":[[9223372036854775807,1]]}');
  const frame = parseServer('{"type":"ack_result","acked":[9223372036854775807,5],"errors":[]}');
  assert.ok(frame !== null && frame.type === "ack_result");
  assert.deepEqual(frame.acked, [9223372036854775807n, 5]);
});

test("the server frames of docs/protocol.md's worked example parse; unknown types are ignored", () => {
  const doc = readFileSync(new URL("../../../../docs/protocol.md", import.meta.url), "utf8");
  const session = doc.slice(doc.indexOf("## A worked example session"));
  const lines = [...session.matchAll(/^S: (\{.*\})$/gm)].map((m) => m[1]!);
  assert.ok(lines.length >= 10);
  for (const line of lines) {
    valid("server_frame", line);
    const frame = parseServer(line);
    assert.ok(frame !== null, line);
  }
  assert.equal(parseServer('{"type":"notice","text":"a frame of a later version"}'), null);
});

test("an unreadable server frame is a ServerFrameError", () => {
  for (const bad of ["not json", "[1]", '{"type":"deliver","queue":"orders"}', '{"type":"ack_result","acked":5,"errors":[]}']) {
    assert.throws(() => parseServer(bad), ServerFrameError, bad);
  }
});
