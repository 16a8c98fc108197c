#!/usr/bin/env node
/**
 * This receiver under the conformance suite's command-line contract (docs/conformance.md):
 *
 *     node dist/src/conformance.js --manager s0=ws://127.0.0.1:8765/ --token SECRET --queue orders \
 *         [--concurrency N] [--extend-after S] [--extend-by S] [--drain-timeout S]
 *
 * Each event's payload says what to do ({"do": ["nack:1.5", "ack"]}: per attempt, the last for later
 * ones); one JSON line per handler start and end and per item the manager refused.
 */

import { setTimeout as sleep } from "node:timers/promises";
import { parseArgs } from "node:util";
import { type Event, Receiver, ReceiverError, Retry } from "./receiver.js";

function line(kind: string, fields: Record<string, unknown>): void {
  const body = JSON.stringify({ kind, t: Date.now() / 1000, ...fields }, (_k, v) =>
    typeof v === "bigint" ? Number(v) : (v as unknown),
  );
  process.stdout.write(body + "\n");
}

function action(payload: unknown, attempt: number): [string, number] {
  const steps = typeof payload === "object" && payload !== null ? (payload as { do?: unknown }).do : undefined;
  if (!Array.isArray(steps) || steps.length === 0) return ["ack", 0];
  const [kind, arg] = String(steps[Math.min(attempt, steps.length) - 1]).split(":");
  if (!["ack", "nack", "fail", "sleep"].includes(kind!)) throw new Error(`unknown action ${kind}`);
  return [kind!, arg === undefined ? 0 : Number(arg)];
}

async function handle(event: Event): Promise<void> {
  const [kind, seconds] = action(event.payload, event.attempt);
  const where = { shard: event.shard, id: event.id, attempt: event.attempt };
  line("start", { ...where, tenant: event.tenant });
  let outcome = "ack";
  try {
    if (kind === "sleep") await sleep(seconds * 1000);
    else if (kind === "nack") {
      outcome = "nack";
      throw new Retry("the payload asked for a nack", seconds);
    } else if (kind === "fail") {
      outcome = "fail";
      throw new Error("the payload asked for a failure");
    }
  } finally {
    line("end", { ...where, outcome });
  }
}

function managers(values: string[]): Record<string, string[]> {
  const out: Record<string, string[]> = {};
  for (const value of values) {
    const at = value.indexOf("=");
    if (at < 1) throw new TypeError(`--manager takes SHARD=URL, got ${value}`);
    (out[value.slice(0, at)] ??= []).push(value.slice(at + 1));
  }
  return out;
}

async function main(): Promise<number> {
  const { values } = parseArgs({
    options: {
      manager: { type: "string", multiple: true },
      token: { type: "string" },
      queue: { type: "string" },
      concurrency: { type: "string", default: "10" },
      "extend-after": { type: "string" },
      "extend-by": { type: "string", default: "60" },
      "drain-timeout": { type: "string", default: "10" },
    },
  });
  if (!values.manager || !values.token || !values.queue) {
    console.error("usage: conformance.js --manager SHARD=URL --token SECRET --queue QUEUE [options]");
    return 2;
  }
  const receiver = new Receiver({
    managers: managers(values.manager),
    queue: values.queue,
    token: values.token,
    handler: handle,
    concurrency: Number(values.concurrency),
    extendAfter: values["extend-after"] === undefined ? null : Number(values["extend-after"]),
    extendBy: Number(values["extend-by"]),
    drainTimeout: Number(values["drain-timeout"]),
    onRefused: (shard, err) => line("refused", { shard, id: err.id, attempt: err.attempt, code: err.code }),
  });
  try {
    await receiver.run({ handleSignals: true });
  } catch (err) {
    if (err instanceof ReceiverError) {
      console.error(`conformance: ${err.message}`);
      return 2;
    }
    throw err;
  }
  return 0;
}

process.exitCode = await main();
