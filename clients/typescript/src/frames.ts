/**
 * The frames of protocol qm.v1, as docs/protocol.md and docs/protocol.schema.json define them:
 * the client frames this receiver sends (typed, and encoded by {@link encode}) and the server
 * frames it reads ({@link parseServer}). test/frames.test.ts checks both against the schema.
 *
 * Event ids are 64-bit integers. JSON.parse would round ids above 2^53, so a message holding an
 * integer of 16 digits or more is parsed with lossless-json, integers beyond 2^53 becoming bigint
 * (in payloads too); every other message takes the native JSON.parse.
 */

import { isInteger, isSafeNumber, parse as losslessParse } from "lossless-json";

export const PROTOCOL = "qm.v1";

/** The limits of docs/protocol.md ("Limits") a client runs into. */
export const MAX_ITEMS_PER_FRAME = 10_000;
export const MAX_CREDIT = 100_000;
export const MAX_EXTEND_SECONDS = 86_400;
export const MAX_ERROR_TEXT = 4096;

/** An event's id on its shard: a number, or a bigint beyond 2^53. */
export type EventId = number | bigint;
/** What a reply echoes of the frame it answers. */
export type Ref = string | number;

// ------------------------------------------------------------------------------- client frames

export interface NackItem {
  id: EventId;
  attempt: number;
  /** seconds before it is due again; absent: the queue's back-off */
  delay?: number;
  /** kept as the event's last_error */
  error?: string;
}

export interface ExtendItem {
  id: EventId;
  attempt: number;
  seconds: number;
}

export type ClientFrame =
  | { type: "subscribe"; queue: string; tenants?: string[]; credit?: number; ref?: Ref }
  | { type: "credit"; credit: number; ref?: Ref }
  | { type: "ack"; events: Array<[EventId, number]>; ref?: Ref }
  | { type: "nack"; events: NackItem[]; ref?: Ref }
  | { type: "extend"; events: ExtendItem[]; ref?: Ref }
  | { type: "ping"; ref?: Ref };

const str = JSON.stringify;

function withRef(body: string, ref: Ref | undefined): string {
  return ref === undefined ? `{${body}}` : `{${body},"ref":${str(ref)}}`;
}

/** The frame's JSON text (ids written as JSON integers, bigint or not). */
export function encode(frame: ClientFrame): string {
  switch (frame.type) {
    case "subscribe": {
      let body = `"type":"subscribe","queue":${str(frame.queue)}`;
      if (frame.tenants !== undefined) body += `,"tenants":${str(frame.tenants)}`;
      if (frame.credit !== undefined) body += `,"credit":${frame.credit}`;
      return withRef(body, frame.ref);
    }
    case "credit":
      return withRef(`"type":"credit","credit":${frame.credit}`, frame.ref);
    case "ack":
      return withRef(`"type":"ack","events":[${frame.events.map(([i, a]) => `[${i},${a}]`).join(",")}]`, frame.ref);
    case "nack": {
      const items = frame.events.map((it) => {
        let item = `{"id":${it.id},"attempt":${it.attempt}`;
        if (it.delay !== undefined) item += `,"delay":${it.delay}`;
        if (it.error !== undefined) item += `,"error":${str(it.error)}`;
        return item + "}";
      });
      return withRef(`"type":"nack","events":[${items.join(",")}]`, frame.ref);
    }
    case "extend": {
      const items = frame.events.map((it) => `{"id":${it.id},"attempt":${it.attempt},"seconds":${it.seconds}}`);
      return withRef(`"type":"extend","events":[${items.join(",")}]`, frame.ref);
    }
    case "ping":
      return withRef(`"type":"ping"`, frame.ref);
  }
}

// ------------------------------------------------------------------------------- server frames

export interface Limits {
  max_frame_bytes: number;
  max_items_per_frame: number;
  max_credit: number;
  max_events_per_deliver: number;
  [other: string]: number;
}

export interface DeliveredEvent {
  id: EventId;
  attempt: number;
  tenant: string;
  partition: number;
  /** epoch seconds by the database clock */
  fire_at: number;
  /** 1 (the highest) to 5; a manager of before priorities sends none */
  priority?: number;
  payload: unknown;
  traceparent?: string;
  tracestate?: string;
  baggage?: string;
}

/** An item of an ack, nack or extend that the manager did not apply. */
export interface ItemError {
  id: EventId;
  attempt: number;
  /** unknown_id, stale, duplicate or unavailable (later versions may add codes) */
  code: string;
  message?: string;
}

export type ServerFrame =
  | { type: "welcome"; protocol: string; shard: string | null; term: number | null; manager: string; limits: Limits }
  | { type: "subscribed"; queue: string; tenants: string[] | null; credit: number; ref?: Ref }
  | { type: "credit_set"; credit: number; ref?: Ref }
  | { type: "deliver"; queue: string; events: DeliveredEvent[] }
  | { type: "ack_result"; acked: EventId[]; errors: ItemError[]; ref?: Ref }
  | { type: "nack_result"; requeued: EventId[]; failed: EventId[]; errors: ItemError[]; ref?: Ref }
  | { type: "extend_result"; extended: Array<{ id: EventId; ack_deadline: number }>; errors: ItemError[]; ref?: Ref }
  | { type: "pong"; time: number; ref?: Ref }
  | { type: "error"; code: string; message: string; ref?: Ref };

/** A server message this client cannot read: the connection is dropped and opened again. */
export class ServerFrameError extends Error {
  override name = "ServerFrameError";
}

const LONG_INTEGER = /\d{16}/;

/** An integer beyond 2^53 as a bigint; every other number as a number. */
function parseNumber(text: string): number | bigint {
  if (isInteger(text) && !isSafeNumber(text)) return BigInt(text);
  return Number(text);
}

function decode(text: string): unknown {
  try {
    return LONG_INTEGER.test(text) ? losslessParse(text, null, parseNumber) : JSON.parse(text);
  } catch (err) {
    throw new ServerFrameError(`a server frame is not JSON: ${(err as Error).message}`);
  }
}

type Check = (value: unknown) => boolean;
const isString: Check = (v) => typeof v === "string";
const isInt: Check = (v) => (typeof v === "number" && Number.isInteger(v)) || typeof v === "bigint";
const isNumber: Check = (v) => typeof v === "number";
const isList: Check = (v) => Array.isArray(v);
const isObject: Check = (v) => typeof v === "object" && v !== null && !Array.isArray(v);
const orNull = (check: Check): Check => (v) => v === null || check(v);

/** The members each server frame must have (others are ignored: docs/protocol.md, "Versioning"). */
const REQUIRED: Record<ServerFrame["type"], Record<string, Check>> = {
  welcome: { protocol: isString, shard: orNull(isString), term: orNull(isInt), manager: isString, limits: isObject },
  subscribed: { queue: isString, tenants: orNull(isList), credit: isInt },
  credit_set: { credit: isInt },
  deliver: { queue: isString, events: isList },
  ack_result: { acked: isList, errors: isList },
  nack_result: { requeued: isList, failed: isList, errors: isList },
  extend_result: { extended: isList, errors: isList },
  pong: { time: isNumber },
  error: { code: isString, message: isString },
};

/**
 * One server message as a typed frame; null for a frame type this version does not know (ignore
 * it). Throws {@link ServerFrameError} for a message that is not a readable frame.
 */
export function parseServer(message: string): ServerFrame | null {
  const value = decode(message);
  if (!isObject(value)) throw new ServerFrameError(`a server frame is not a JSON object: ${message.slice(0, 200)}`);
  const frame = value as Record<string, unknown>;
  const type = frame["type"];
  if (typeof type !== "string" || !Object.hasOwn(REQUIRED, type)) return null;
  for (const [member, check] of Object.entries(REQUIRED[type as ServerFrame["type"]])) {
    if (!check(frame[member])) {
      throw new ServerFrameError(`unreadable ${type} frame: '${member}' is missing or mistyped: ${message.slice(0, 200)}`);
    }
  }
  if (type === "deliver") {
    for (const ev of frame["events"] as unknown[]) {
      const e = ev as Record<string, unknown> | null;
      if (!isObject(e) || !isInt(e!["id"]) || !isInt(e!["attempt"]) || !isString(e!["tenant"])) {
        throw new ServerFrameError(`unreadable deliver frame: an event without id, attempt or tenant`);
      }
    }
  }
  return frame as unknown as ServerFrame;
}

/** A key for an id in maps (a bigint and a number of the same value are the same event). */
export function idKey(id: EventId): string {
  return String(id);
}
