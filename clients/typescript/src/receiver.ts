/**
 * A receiver of protocol qm.v1 (docs/protocol.md): one websocket per shard to its active manager,
 * an async handler per event, credit from free handler slots, batched acks, nacks and lease
 * extensions, failover across a shard's managers, shards from a topology file, drain on signals.
 *
 *     const receiver = new Receiver({ managers: { s0: ["ws://127.0.0.1:8765/"] }, queue: "orders",
 *                                     token: "change-me-to-a-long-secret", handler: async (event) => {} });
 *     await receiver.run({ handleSignals: true });   // until SIGTERM/SIGINT or stop(), then drained
 *
 * A handler that returns acks its event; one that throws nacks it (a {@link Retry} with a delay
 * says when it is due again, any other error leaves it to the queue's back-off). Delivery is at
 * least once: handlers must be idempotent.
 */

import { readFileSync, statSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";
import { parse as parseToml } from "smol-toml";
import WebSocket from "ws";
import {
  type ClientFrame,
  type DeliveredEvent,
  encode,
  type EventId,
  type ExtendItem,
  idKey,
  type ItemError,
  MAX_ERROR_TEXT,
  MAX_EXTEND_SECONDS,
  MAX_ITEMS_PER_FRAME,
  type NackItem,
  parseServer,
  PROTOCOL,
  type ServerFrame,
  ServerFrameError,
} from "./frames.js";

/** One delivered event (one attempt of it). */
export interface Event {
  queue: string;
  /** the shard it came from; ids are unique per queue and shard */
  shard: string;
  id: EventId;
  /** which delivery this is: an ack names (id, attempt) */
  attempt: number;
  tenant: string;
  partition: number;
  /** when it was due, epoch seconds by the database clock */
  fireAt: number;
  /** 1 (the highest) to 5 */
  priority?: number;
  payload: unknown;
  traceparent?: string;
  tracestate?: string;
  baggage?: string;
}

export type Handler = (event: Event) => Promise<void> | void;

/** Thrown by a handler: nack the event, due again after `delay` seconds (or the queue's back-off). */
export class Retry extends Error {
  override name = "Retry";
  constructor(
    message = "retry requested by the handler",
    readonly delay?: number,
  ) {
    super(message);
  }
}

/** The receiver cannot go on: a manager refused its token (HTTP 401/403) or its subscription. */
export class ReceiverError extends Error {
  override name = "ReceiverError";
}

export interface ReceiverOptions {
  queue: string;
  handler: Handler;
  /** the bearer secret of a token that covers the queue */
  token: string;
  /** each shard's manager URLs (the active one and its standbys), by shard name */
  managers?: Record<string, string[]>;
  /** a topology file (TOML, `[[shards]]` with `managers`): its shards, followed when it changes */
  topologyFile?: string;
  /** handlers at once, per shard (default 10): the credit granted on each shard's connection */
  concurrency?: number;
  /** only these tenants' events */
  tenants?: string[];
  /** extend the ack deadline of a handler running this long, seconds (default 5; null: never) */
  extendAfter?: number | null;
  /** by this much each time, seconds (default 60) */
  extendBy?: number;
  /** on stop, wait this long for the handlers running and their acks, seconds (default 30) */
  drainTimeout?: number;
  /** the reconnect pause grows from this (seconds, default 0.05) ... */
  backoffInitial?: number;
  /** ... to this (default 2) */
  backoffMax?: number;
  /** the largest message accepted, bytes (default 16 MiB; a deliver holds a payload whole) */
  maxPayload?: number;
  /** every item the manager refused in an ack, nack or extend result (error frames are logged) */
  onRefused?: (shard: string, error: ItemError) => void;
  /** log lines (default: warnings and errors to stderr) */
  log?: (level: "debug" | "info" | "warn" | "error", message: string) => void;
}

export interface ReceiverStats {
  delivered: number;
  acked: number;
  nacked: number;
  deadLettered: number;
  extended: number;
  /** results dropped because the event was no longer this connection's (stale, unknown_id, reconnect) */
  dropped: number;
  /** successful subscriptions (first connections and reconnections) */
  connects: number;
  /** HTTP refusals of the websocket handshake, by status */
  refused: Record<number, number>;
}

type Sent =
  | { type: "ack"; items: Array<[EventId, number]> }
  | { type: "nack"; items: NackItem[] }
  | { type: "extend"; items: ExtendItem[] }
  | { type: "credit" };

/** The link to one shard: its connection of the moment, its handler slots, what is on its way. */
class Link {
  private ws: WebSocket | null = null;
  private urlIndex = 0;
  /** the connection's number: results of older connections are dropped */
  private gen = 0;
  private subscribed = false;
  private lastCredit: number | null = null;
  /** id -> attempt of the events in hand on the current connection */
  private readonly inHand = new Map<string, number>();
  private readonly waiting: Event[] = [];
  /** handlers running, of every connection */
  private running = 0;
  private acks: Array<[EventId, number]> = [];
  private nacks: NackItem[] = [];
  private readonly extends = new Map<string, ExtendItem>();
  private readonly outstanding = new Map<number, Sent>();
  private nextRef = 0;
  private flushing = false;
  private delay: number;
  draining = false;
  private stopped = false;
  private changed: (() => void) | null = null;
  readonly whenSubscribed: Promise<void>;
  private resolveSubscribed!: () => void;

  constructor(
    private readonly r: Receiver,
    readonly shard: string,
    public urls: string[],
  ) {
    this.delay = r.backoffInitial;
    this.whenSubscribed = new Promise((resolve) => (this.resolveSubscribed = resolve));
  }

  /** Connect, and reconnect, until drained. Rejects with ReceiverError when refused for good. */
  async run(): Promise<void> {
    while (!this.stopped) {
      const url = this.urls[this.urlIndex % this.urls.length]!;
      const outcome = await this.connect(url);
      if (outcome instanceof ReceiverError) throw outcome;
      if (this.draining && !this.busy()) break;
      if (outcome !== "subscribed") this.urlIndex += 1; // try the next manager
      await sleep(this.delay * 1000 * (0.5 + Math.random()));
      this.delay = Math.min(this.delay * 2, this.r.backoffMax);
    }
  }

  private connect(url: string): Promise<"subscribed" | "failed" | ReceiverError> {
    return new Promise((resolve) => {
      let result: "subscribed" | "failed" | ReceiverError = "failed";
      const ws = new WebSocket(url, PROTOCOL, {
        headers: { Authorization: `Bearer ${this.r.token}` },
        maxPayload: this.r.maxPayload,
        perMessageDeflate: false,
        handshakeTimeout: 5000,
      });
      this.ws = ws;
      const gen = ++this.gen;
      ws.on("unexpected-response", (_req, res) => {
        const status = res.statusCode ?? 0;
        this.r.stats.refused[status] = (this.r.stats.refused[status] ?? 0) + 1;
        if (status === 401 || status === 403) {
          result = new ReceiverError(`shard ${this.shard}: manager ${url} refused the token (HTTP ${status})`);
        } else {
          this.r.log("info", `manager ${url} refused the connection: HTTP ${status}`);
        }
        ws.terminate();
      });
      ws.on("error", (err) => this.r.log("info", `connection to ${url}: ${err.message}`));
      ws.on("message", (data, isBinary) => {
        if (gen !== this.gen) return;
        const text = isBinary ? Buffer.from(data as Buffer).toString("utf8") : data.toString();
        try {
          const fatal = this.receive(text);
          if (fatal !== null) {
            result = fatal;
            ws.close(1000);
          } else if (this.subscribed && result === "failed") {
            result = "subscribed";
            this.delay = this.r.backoffInitial;
          }
        } catch (err) {
          if (!(err instanceof ServerFrameError)) throw err;
          this.r.log("warn", `protocol error from ${url}, reconnecting: ${err.message}`);
          ws.close(1002, "unreadable frame");
        }
      });
      ws.on("close", (code, reason) => {
        if (gen === this.gen) this.lost();
        this.r.log("info", `connection to ${url} closed: ${code} ${reason.toString()}`);
        resolve(result);
      });
    });
  }

  /** One server message; a ReceiverError when the subscription was refused for good. */
  private receive(text: string): ReceiverError | null {
    const frame = parseServer(text);
    if (frame === null) return null; // a frame of a later version
    switch (frame.type) {
      case "welcome":
        this.lastCredit = this.credit();
        this.send({
          type: "subscribe",
          queue: this.r.queue,
          credit: this.lastCredit,
          ref: "subscribe",
          ...(this.r.tenants !== undefined ? { tenants: this.r.tenants } : {}),
        });
        return null;
      case "subscribed":
        this.subscribed = true;
        this.r.stats.connects += 1;
        this.resolveSubscribed();
        this.schedule();
        return null;
      case "deliver":
        this.deliver(frame.queue, frame.events);
        return null;
      case "ack_result":
        this.settled(frame.ref, frame.acked, frame.errors, "ack");
        return null;
      case "nack_result":
        this.r.stats.nacked += frame.requeued.length;
        this.r.stats.deadLettered += frame.failed.length;
        this.settled(frame.ref, [...frame.requeued, ...frame.failed], frame.errors, "nack");
        return null;
      case "extend_result":
        this.outstanding.delete(frame.ref as number);
        this.r.stats.extended += frame.extended.length;
        for (const err of frame.errors) {
          this.r.refused(this.shard, err);
          if (err.code !== "unavailable") this.drop(err.id, err.attempt);
        }
        return null;
      case "error":
        return this.error(frame);
      case "credit_set":
      case "pong":
        return null;
    }
  }

  private deliver(queue: string, events: DeliveredEvent[]): void {
    for (const raw of events) {
      const event: Event = {
        queue,
        shard: this.shard,
        id: raw.id,
        attempt: raw.attempt,
        tenant: raw.tenant,
        partition: raw.partition,
        fireAt: raw.fire_at,
        payload: raw.payload,
      };
      if (raw.priority !== undefined) event.priority = raw.priority;
      if (raw.traceparent !== undefined) event.traceparent = raw.traceparent;
      if (raw.tracestate !== undefined) event.tracestate = raw.tracestate;
      if (raw.baggage !== undefined) event.baggage = raw.baggage;
      this.r.stats.delivered += 1;
      this.inHand.set(idKey(event.id), event.attempt);
      if (this.running < this.r.concurrency) this.start(event);
      else this.waiting.push(event);
    }
  }

  private settled(ref: unknown, done: EventId[], errors: ItemError[], kind: "ack" | "nack"): void {
    const sent = typeof ref === "number" ? this.outstanding.get(ref) : undefined;
    if (typeof ref === "number") this.outstanding.delete(ref);
    if (kind === "ack") this.r.stats.acked += done.length;
    for (const id of done) this.inHand.delete(idKey(id));
    let retry = false;
    for (const err of errors) {
      this.r.refused(this.shard, err);
      if (err.code === "unavailable") {
        // not written this time: send it again on this connection, a little later
        if (kind === "ack") this.acks.push([err.id, err.attempt]);
        else if (sent?.type === "nack") {
          const item = sent.items.find((it) => idKey(it.id) === idKey(err.id));
          if (item !== undefined) this.nacks.push(item);
        }
        retry = true;
      } else if (err.code !== "duplicate") {
        this.drop(err.id, err.attempt); // stale, unknown_id: no longer ours
      }
    }
    if (retry) setTimeout(() => this.schedule(), 100);
    this.wake();
  }

  private error(frame: Extract<ServerFrame, { type: "error" }>): ReceiverError | null {
    if (frame.ref === "subscribe") {
      if (frame.code === "forbidden") {
        return new ReceiverError(`shard ${this.shard}: subscribe to ${this.r.queue} refused: ${frame.message}`);
      }
      this.ws?.close(1000); // unknown_queue, draining: reconnect after a pause
      return null;
    }
    const sent = typeof frame.ref === "number" ? this.outstanding.get(frame.ref) : undefined;
    if (sent === undefined) {
      this.r.log("warn", `shard ${this.shard}: error frame: ${frame.code}: ${frame.message}`);
      return null;
    }
    this.outstanding.delete(frame.ref as number);
    if (frame.code === "unavailable") {
      if (sent.type === "ack") this.acks.push(...sent.items);
      else if (sent.type === "nack") this.nacks.push(...sent.items);
      setTimeout(() => this.schedule(), 100);
    } else {
      this.r.log("error", `shard ${this.shard}: ${sent.type} frame refused: ${frame.code}: ${frame.message}`);
      if (sent.type === "ack") for (const [id, attempt] of sent.items) this.drop(id, attempt);
      else if (sent.type === "nack") for (const it of sent.items) this.drop(it.id, it.attempt);
    }
    return null;
  }

  private drop(id: EventId, attempt: number): void {
    const key = idKey(id);
    if (this.inHand.get(key) === attempt) {
      this.inHand.delete(key);
      this.r.stats.dropped += 1;
      this.wake();
    }
  }

  private holds(event: Event, gen: number): boolean {
    return gen === this.gen && this.inHand.get(idKey(event.id)) === event.attempt;
  }

  // ------------------------------------------------------------------ handlers

  private start(event: Event): void {
    this.running += 1;
    const gen = this.gen;
    let timer: NodeJS.Timeout | undefined;
    if (this.r.extendAfter !== null) {
      const ask = (): void => {
        if (!this.holds(event, gen)) return;
        this.extends.set(idKey(event.id), { id: event.id, attempt: event.attempt, seconds: this.r.extendBy });
        this.schedule();
        timer = setTimeout(ask, (this.r.extendBy / 2) * 1000);
      };
      timer = setTimeout(ask, this.r.extendAfter * 1000);
    }
    void this.invoke(event).then((outcome) => {
      clearTimeout(timer);
      this.running -= 1;
      if (!this.holds(event, gen)) {
        this.r.stats.dropped += 1; // delivered on a connection that has ended, or taken back meanwhile
      } else {
        this.extends.delete(idKey(event.id));
        if (outcome === null) this.acks.push([event.id, event.attempt]);
        else this.nacks.push(outcome);
      }
      while (this.running < this.r.concurrency && this.waiting.length > 0) this.start(this.waiting.shift()!);
      this.schedule();
    });
  }

  /** null: ack; otherwise the nack. */
  private async invoke(event: Event): Promise<NackItem | null> {
    try {
      await this.r.handler(event);
      return null;
    } catch (err) {
      const error = err instanceof Error ? `${err.name}: ${err.message}` : String(err);
      const item: NackItem = { id: event.id, attempt: event.attempt, error: error.slice(0, MAX_ERROR_TEXT) };
      if (err instanceof Retry && err.delay !== undefined) item.delay = err.delay;
      return item;
    }
  }

  /** The credit to grant: the free handler slots (handlers of an old connection hold theirs). */
  private credit(): number {
    if (this.draining) return 0;
    const busyElsewhere = Math.max(0, this.running - this.inHand.size);
    return Math.max(0, this.r.concurrency - busyElsewhere);
  }

  // ------------------------------------------------------------------ frames out

  /** Send what there is to send once the handlers that finish in this turn have finished. */
  private schedule(): void {
    if (this.flushing) return;
    this.flushing = true;
    setImmediate(() => {
      this.flushing = false;
      this.flush();
    });
  }

  private flush(): void {
    if (this.ws === null || this.ws.readyState !== WebSocket.OPEN || !this.subscribed) return;
    const credit = this.credit();
    if (credit !== this.lastCredit) {
      this.lastCredit = credit;
      this.send({ type: "credit", credit, ref: this.remember({ type: "credit" }) });
    }
    while (this.acks.length > 0) {
      const items = this.acks.splice(0, MAX_ITEMS_PER_FRAME);
      this.send({ type: "ack", events: items, ref: this.remember({ type: "ack", items }) });
    }
    while (this.nacks.length > 0) {
      const items = this.nacks.splice(0, MAX_ITEMS_PER_FRAME);
      this.send({ type: "nack", events: items, ref: this.remember({ type: "nack", items }) });
    }
    if (this.extends.size > 0) {
      const all = [...this.extends.values()];
      this.extends.clear();
      for (let k = 0; k < all.length; k += MAX_ITEMS_PER_FRAME) {
        const items = all.slice(k, k + MAX_ITEMS_PER_FRAME);
        this.send({ type: "extend", events: items, ref: this.remember({ type: "extend", items }) });
      }
    }
  }

  private remember(sent: Sent): number {
    this.nextRef += 1;
    this.outstanding.set(this.nextRef, sent);
    return this.nextRef;
  }

  private send(frame: ClientFrame): void {
    this.ws?.send(encode(frame));
  }

  // ------------------------------------------------------------------ connection lost, drain

  /** The connection is gone: forget what it held (the manager fires it again). */
  private lost(): void {
    this.inHand.clear();
    this.waiting.length = 0;
    this.acks = [];
    this.nacks = [];
    this.extends.clear();
    this.outstanding.clear();
    this.subscribed = false;
    this.lastCredit = null;
    this.ws = null;
    this.wake();
  }

  private busy(): boolean {
    return this.running > 0 || this.inHand.size > 0 || this.acks.length > 0 || this.nacks.length > 0;
  }

  private wake(): void {
    this.changed?.();
  }

  /** Credit 0, then wait (at most `timeout` seconds) for the handlers and their acks; close. */
  async drain(timeout: number): Promise<void> {
    this.draining = true;
    this.schedule();
    const deadline = Date.now() + timeout * 1000;
    while (this.busy() && this.ws !== null && Date.now() < deadline) {
      await new Promise<void>((resolve) => {
        this.changed = resolve;
        setTimeout(resolve, 50);
      });
      this.changed = null;
    }
    if (this.inHand.size > 0) this.r.log("warn", `drain of shard ${this.shard}: ${this.inHand.size} event(s) left in hand`);
    this.stopped = true;
    this.ws?.close(1000);
  }
}

/** Receive events of one queue from every shard's active manager. */
export class Receiver {
  readonly queue: string;
  readonly handler: Handler;
  readonly token: string;
  readonly concurrency: number;
  readonly tenants: string[] | undefined;
  readonly extendAfter: number | null;
  readonly extendBy: number;
  readonly drainTimeout: number;
  readonly backoffInitial: number;
  readonly backoffMax: number;
  readonly maxPayload: number;
  readonly stats: ReceiverStats = {
    delivered: 0,
    acked: 0,
    nacked: 0,
    deadLettered: 0,
    extended: 0,
    dropped: 0,
    connects: 0,
    refused: {},
  };
  private readonly options: ReceiverOptions;
  private readonly links = new Map<string, Link>();
  private readonly tasks = new Map<Link, Promise<void>>();
  private stopping: Promise<void> | null = null;
  private stopRequested!: () => void;
  private readonly stopSignal = new Promise<void>((resolve) => (this.stopRequested = resolve));

  constructor(options: ReceiverOptions) {
    this.options = options;
    this.queue = options.queue;
    this.handler = options.handler;
    this.token = options.token;
    this.concurrency = options.concurrency ?? 10;
    this.tenants = options.tenants;
    this.extendAfter = options.extendAfter === undefined ? 5 : options.extendAfter;
    this.extendBy = options.extendBy ?? 60;
    this.drainTimeout = options.drainTimeout ?? 30;
    this.backoffInitial = options.backoffInitial ?? 0.05;
    this.backoffMax = options.backoffMax ?? 2;
    this.maxPayload = options.maxPayload ?? 16 << 20;
    if (!Number.isInteger(this.concurrency) || this.concurrency < 1) {
      throw new RangeError(`concurrency must be a positive integer, got ${this.concurrency}`);
    }
    if (this.extendAfter !== null && !(this.extendAfter > 0)) {
      throw new RangeError(`extendAfter must be positive or null, got ${this.extendAfter}`);
    }
    if (!(this.extendBy > 0 && this.extendBy <= MAX_EXTEND_SECONDS)) {
      throw new RangeError(`extendBy must be in (0, ${MAX_EXTEND_SECONDS}] seconds, got ${this.extendBy}`);
    }
    if (options.managers === undefined && options.topologyFile === undefined) {
      throw new TypeError("give the managers of each shard, or a topology file");
    }
    for (const [shard, urls] of Object.entries(this.shardsNow())) {
      if (urls.length === 0) throw new TypeError(`shard ${shard}: give at least one manager URL`);
      for (const u of urls) new URL(u); // a TypeError for a malformed URL
    }
  }

  log(level: "debug" | "info" | "warn" | "error", message: string): void {
    if (this.options.log !== undefined) this.options.log(level, message);
    else if (level === "warn" || level === "error") console.error(`qm receiver: ${message}`);
  }

  refused(shard: string, error: ItemError): void {
    this.options.onRefused?.(shard, error);
  }

  /** The shards and their managers: the topology file's (its `managers`), then the given URLs. */
  private shardsNow(): Record<string, string[]> {
    const out: Record<string, string[]> = {};
    if (this.options.topologyFile !== undefined) {
      const doc = parseToml(readFileSync(this.options.topologyFile, "utf8")) as { shards?: unknown };
      if (!Array.isArray(doc.shards)) throw new TypeError(`${this.options.topologyFile}: no [[shards]]`);
      for (const s of doc.shards as Array<{ name?: unknown; managers?: unknown }>) {
        if (typeof s.name !== "string") throw new TypeError(`${this.options.topologyFile}: a shard without a name`);
        out[s.name] = Array.isArray(s.managers) ? s.managers.map(String) : [];
      }
    }
    return { ...out, ...(this.options.managers ?? {}) };
  }

  /** Resolves once every shard's connection has subscribed. */
  async waitSubscribed(): Promise<void> {
    await Promise.all([...this.links.values()].map((l) => l.whenSubscribed));
  }

  /** Receive until {@link stop} (or SIGTERM/SIGINT with handleSignals), then drain. Rejects with
   * {@link ReceiverError} when a manager refuses the token or the subscription. */
  async run(options: { handleSignals?: boolean } = {}): Promise<void> {
    const onSignal = (): void => this.stop();
    if (options.handleSignals) {
      process.on("SIGTERM", onSignal);
      process.on("SIGINT", onSignal);
    }
    for (const [shard, urls] of Object.entries(this.shardsNow())) this.open(shard, urls);
    const follow = this.options.topologyFile !== undefined ? this.follow() : null;
    try {
      while (this.tasks.size > 0) {
        if (this.stopping === null) {
          await Promise.race([...this.tasks.values(), this.stopSignal]);
        } else {
          await this.stopping; // every link drained and closed: wait for their loops to end
          await Promise.all([...this.tasks.values()]);
        }
      }
    } catch (err) {
      this.stop();
      await Promise.allSettled([...this.tasks.values()]);
      throw err;
    } finally {
      if (options.handleSignals) {
        process.off("SIGTERM", onSignal);
        process.off("SIGINT", onSignal);
      }
      await follow;
    }
  }

  private open(shard: string, urls: string[]): void {
    const link = new Link(this, shard, urls);
    this.links.set(shard, link);
    const task = link.run().finally(() => this.tasks.delete(link));
    this.tasks.set(link, task);
  }

  /** Follow the topology file: shards that appear are opened, shards that leave are drained. */
  private async follow(): Promise<void> {
    const path = this.options.topologyFile!;
    let stamp = "";
    while (this.stopping === null) {
      try {
        const st = statSync(path);
        const now = `${st.mtimeMs}:${st.size}:${st.ino}`;
        if (stamp !== "" && now !== stamp) {
          const shards = this.shardsNow();
          for (const [shard, urls] of Object.entries(shards)) {
            const link = this.links.get(shard);
            if (link === undefined) this.open(shard, urls);
            else link.urls = urls;
          }
          for (const [shard, link] of this.links) {
            if (!(shard in shards)) {
              this.links.delete(shard);
              void link.drain(this.drainTimeout);
            }
          }
        }
        stamp = now;
      } catch (err) {
        this.log("warn", `topology file ${path}: ${(err as Error).message}`);
      }
      await Promise.race([sleep(1000), this.stopSignal]);
    }
  }

  /** Stop: every shard's link grants no more credit, finishes its handlers, acks and closes. */
  stop(): void {
    if (this.stopping !== null) return;
    this.stopping = Promise.all([...this.links.values()].map((l) => l.drain(this.drainTimeout))).then(() => undefined);
    this.stopRequested();
  }
}
