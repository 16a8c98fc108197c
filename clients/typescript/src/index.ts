export { Receiver, ReceiverError, Retry } from "./receiver.js";
export type { Event, Handler, ReceiverOptions, ReceiverStats } from "./receiver.js";
export { encode, parseServer, PROTOCOL, ServerFrameError } from "./frames.js";
export type { ClientFrame, DeliveredEvent, EventId, ItemError, ServerFrame } from "./frames.js";
