// The library from TypeScript (docs/receivers.md, "TypeScript"): the README's two local shards.
import { type Event, Receiver, Retry } from "../src/index.js";

async function handle(event: Event): Promise<void> {
  if (event.payload === null) throw new Retry("nothing to do yet", 30); // nack, due again in 30 s
  console.log(event.shard, event.id, event.attempt, event.tenant, event.payload);
} // return: ack; throw anything else: nack (the queue's back-off)

const receiver = new Receiver({
  managers: { s0: ["ws://127.0.0.1:8765/"], s1: ["ws://127.0.0.1:8766/"] },
  queue: "orders",
  token: "change-me-to-a-long-secret",
  handler: handle,
  concurrency: 8,
});
await receiver.run({ handleSignals: true }); // until SIGTERM or Ctrl-C; then it drains
