#!/usr/bin/env node
/**
 * Receive a queue with a handler module, like `qm receive` (docs/receivers.md, "TypeScript"):
 *
 *     node dist/src/cli.js --queue orders --manager s0=ws://127.0.0.1:8765/ --token SECRET ./handler.mjs
 *     node dist/src/cli.js --queue orders --topology local/topology.toml --token SECRET ./handler.mjs
 *
 * The module exports `handle(event)` (or a default function): return to ack, throw to nack.
 * SIGTERM or SIGINT drains (the handlers running finish and are acked) and exits 0.
 */

import { resolve } from "node:path";
import { pathToFileURL } from "node:url";
import { parseArgs } from "node:util";
import { type Handler, Receiver, ReceiverError } from "./receiver.js";

const USAGE =
  "usage: cli.js --queue QUEUE (--manager SHARD=URL ... | --topology FILE) [--token SECRET] " +
  "[--concurrency N] [--extend-after S] [--drain-timeout S] HANDLER_MODULE";

async function main(): Promise<number> {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      queue: { type: "string" },
      manager: { type: "string", multiple: true },
      topology: { type: "string" },
      token: { type: "string" },
      concurrency: { type: "string", default: "10" },
      "extend-after": { type: "string", default: "5" },
      "drain-timeout": { type: "string", default: "30" },
    },
  });
  const token = values.token ?? process.env["QM_TOKEN"];
  if (!values.queue || positionals.length !== 1 || !token || (!values.manager && !values.topology)) {
    console.error(USAGE);
    return 2;
  }
  const module = (await import(pathToFileURL(resolve(positionals[0]!)).href)) as { handle?: Handler; default?: Handler };
  const handler = module.handle ?? module.default;
  if (typeof handler !== "function") {
    console.error(`${positionals[0]} exports no handle(event) function`);
    return 2;
  }
  const managers: Record<string, string[]> = {};
  for (const value of values.manager ?? []) {
    const at = value.indexOf("=");
    if (at < 1) throw new TypeError(`--manager takes SHARD=URL, got ${value}`);
    (managers[value.slice(0, at)] ??= []).push(value.slice(at + 1));
  }
  const extendAfter = Number(values["extend-after"]);
  const receiver = new Receiver({
    queue: values.queue,
    token,
    handler,
    ...(values.manager ? { managers } : {}),
    ...(values.topology ? { topologyFile: values.topology } : {}),
    concurrency: Number(values.concurrency),
    extendAfter: extendAfter > 0 ? extendAfter : null,
    drainTimeout: Number(values["drain-timeout"]),
  });
  try {
    await receiver.run({ handleSignals: true });
  } catch (err) {
    if (err instanceof ReceiverError) {
      console.error(err.message);
      return 1;
    }
    throw err;
  }
  console.error(`drained: ${receiver.stats.acked} acked, ${receiver.stats.nacked} nacked`);
  return 0;
}

process.exitCode = await main();
