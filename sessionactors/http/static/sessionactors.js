// sessionactors.js: a small browser client for the sessionactors HTTP gateway.
//
// No dependencies and no build step: copy this file next to your page and
//
//   import { SessionsClient, newIdempotencyKey } from "./sessionactors.js";
//   const client = new SessionsClient({ token: "..." });          // token: optional
//   const reply = await client.send("support-1", "Hello");         // the reply, once durable
//   // sent again, with its key, if no answer came (a network error): its turn runs once
//   await client.send("support-1", "Hi", { idempotencyKey: newIdempotencyKey(), retries: 3 });
//   for await (const event of client.stream("support-1", "Hi")) {  // one turn's events
//     if (event.type === "Delta") show(event.text);
//   }
//   const sub = client.subscribe("support-1", {                    // every event, resumed
//     after: state.event_seq,                                      // after a drop with
//     onEvent: (event) => render(event),                           // Last-Event-ID
//     onStatus: (status) => console.log(status),
//   });
//   sub.close();
//
// Events are the gateway's JSON form: {"type": "Delta", "session_id": ..., "seq": ...,
// ...fields}. Frames that are not session events have a lower-case type: "reply" (a
// turn replayed for an idempotency key) and "error" ({"error", "message", "status"}).
// It uses fetch (not EventSource), so that it can send a bearer token and POST.

/** An HTTP error answered by the gateway: `status` and its JSON `body`. */
export class HttpError extends Error {
  constructor(status, body) {
    super((body && body.message) || `HTTP ${status}`);
    this.name = "HttpError";
    this.status = status;
    this.body = body;
  }
}

/**
 * Read server-sent events from a fetch Response: yields {id, data} with `data` parsed
 * from JSON (comments and retry-only blocks are skipped).
 */
export async function* readEvents(response, signal) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  const onAbort = () => reader.cancel().catch(() => {});
  if (signal) signal.addEventListener("abort", onAbort, { once: true });
  try {
    while (true) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let id = null;
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("id:")) id = line.slice(3).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) yield { id, data: JSON.parse(data.join("\n")) };
      }
    }
  } finally {
    if (signal) signal.removeEventListener("abort", onAbort);
    reader.releaseLock();
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** The first wait before a request is sent again, and the longest, in milliseconds. */
const RETRY_MS = 500;
const MAX_RETRY_MS = 3000;

/**
 * A new idempotency key (128 random bits, as hex): make one for each message a person
 * types, and send it with that message's every retry, so that the turn runs once
 * however often the message is sent (see the gateway's idempotency how-to).
 */
export function newIdempotencyKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (byte) => byte.toString(16).padStart(2, "0")).join("");
}

/** A client of one gateway: JSON calls, one turn's stream, and resumable subscriptions. */
export class SessionsClient {
  /**
   * @param {object} options
   * @param {string} [options.baseUrl] where the gateway is mounted (default: this page's
   *   directory)
   * @param {string|null} [options.token] sent as `Authorization: Bearer <token>`
   */
  constructor({ baseUrl = undefined, token = null } = {}) {
    this.baseUrl = new URL(baseUrl ?? ".", document.baseURI);
    this.token = token;
  }

  /** The URL of a gateway path such as `sessions/a/events`. */
  url(path) {
    return new URL(path, this.baseUrl);
  }

  headers(extra = {}) {
    const headers = { ...extra };
    if (this.token) headers.Authorization = `Bearer ${this.token}`;
    return headers;
  }

  sessionPath(name, rest = "") {
    return `sessions/${encodeURIComponent(name)}${rest}`;
  }

  /**
   * `fetch(url, init)`, sent again after a failure that got no answer (a network error:
   * the request may or may not have reached the server) up to `retries` times, waiting
   * 0.5 s, then twice as long each time, up to 3 s. Only a request that carries an
   * idempotency key may be sent again (a TypeError otherwise): its turn then runs once.
   */
  async fetchAnswered(url, init, { retries = 0, idempotencyKey = null, signal = undefined } = {}) {
    if (retries > 0 && idempotencyKey === null) {
      throw new TypeError("retries need an idempotencyKey: a message sent again without one may run twice");
    }
    let delay = RETRY_MS;
    for (let attempt = 0; ; attempt += 1) {
      try {
        return await fetch(url, init);
      } catch (error) {
        if (!(error instanceof TypeError) || attempt >= retries || signal?.aborted) throw error;
      }
      await sleep(delay);
      if (signal?.aborted) throw signal.reason;
      delay = Math.min(delay * 2, MAX_RETRY_MS);
    }
  }

  /** One JSON request; resolves to the answer, or throws an HttpError. */
  async request(method, path, body = undefined, { retries = 0, idempotencyKey = null } = {}) {
    const init = { method, headers: this.headers({ Accept: "application/json" }) };
    if (body !== undefined) init.body = JSON.stringify(body);
    // (a POST says JSON even without a body: the gateway refuses a form-like POST from
    // another origin, and a proxy that rewrites Host makes this page look like one)
    if (method !== "GET") init.headers["Content-Type"] = "application/json";
    const response = await this.fetchAnswered(this.url(path), init, { retries, idempotencyKey });
    const data = await response.json().catch(() => null);
    if (!response.ok) throw new HttpError(response.status, data);
    return data;
  }

  /** A page of sessions: {sessions: [...], next: name or null}. */
  listSessions({ limit = 100, after = null } = {}) {
    const query = new URLSearchParams({ limit: String(limit) });
    if (after !== null) query.set("after", after);
    return this.request("GET", `sessions?${query}`);
  }

  /** A session's state: status, metadata, messages, pending_reviews, event_seq. */
  getSession(name) {
    return this.request("GET", this.sessionPath(name));
  }

  /**
   * Send a message and wait for the reply ({turn_id, text, message, reviews}). With an
   * `idempotencyKey`, `retries` says how often it is sent again when no answer came
   * (see `fetchAnswered`).
   */
  send(name, text, { idempotencyKey = null, agent = null, retries = 0 } = {}) {
    const body = { text, idempotency_key: idempotencyKey, agent };
    return this.request("POST", this.sessionPath(name, "/messages"), body, {
      retries,
      idempotencyKey,
    });
  }

  /**
   * Send a message and iterate over that turn's events, ending with its outcome. With
   * an `idempotencyKey`, `retries` says how often it is sent again when no answer came
   * (see `fetchAnswered`); once its answer has begun, the turn is the session's: a
   * stream cut off then is not sent again (follow the session's events, `subscribe`).
   */
  async *stream(name, text, { idempotencyKey = null, agent = null, signal = undefined, retries = 0 } = {}) {
    const init = {
      method: "POST",
      headers: this.headers({ Accept: "text/event-stream", "Content-Type": "application/json" }),
      body: JSON.stringify({ text, idempotency_key: idempotencyKey, agent }),
      signal,
    };
    const url = this.url(this.sessionPath(name, "/messages"));
    const response = await this.fetchAnswered(url, init, { retries, idempotencyKey, signal });
    if (!response.ok) throw new HttpError(response.status, await response.json().catch(() => null));
    for await (const { data } of readEvents(response, signal)) yield data;
  }

  /**
   * Every event of a session, live, resumed after a dropped connection with
   * Last-Event-ID. `after`: the seq to start after (the `event_seq` of the state you
   * rendered), or null for live events only. `onStatus` gets "connecting", "open",
   * "reconnecting", or "failed" (with the error: a 4xx answer is not retried).
   * `onExpired(error)` is called when the events after the cursor are gone (410):
   * reload the state and subscribe again. Returns {close(), lastSeq}.
   */
  subscribe(name, { after = null, onEvent, onStatus = () => {}, onExpired = null, retryMs = 500 } = {}) {
    const controller = new AbortController();
    const subscription = {
      lastSeq: after,
      close: () => controller.abort(),
    };
    const run = async () => {
      let delay = retryMs;
      while (!controller.signal.aborted) {
        onStatus("connecting");
        try {
          const headers = this.headers({ Accept: "text/event-stream" });
          if (subscription.lastSeq !== null) headers["Last-Event-ID"] = String(subscription.lastSeq);
          const response = await fetch(this.url(this.sessionPath(name, "/events")), {
            headers,
            signal: controller.signal,
          });
          if (!response.ok) throw new HttpError(response.status, await response.json().catch(() => null));
          onStatus("open");
          for await (const { id, data } of readEvents(response, controller.signal)) {
            delay = retryMs;  // (not before: a draining server answers an empty stream)
            if (id !== null) subscription.lastSeq = Number(id);
            onEvent(data);
          }
        } catch (error) {
          if (controller.signal.aborted) return;
          if (error instanceof HttpError && error.status === 410 && onExpired) {
            onStatus("failed", error);
            onExpired(error);
            return;
          }
          if (error instanceof HttpError && error.status < 500 && error.status !== 429) {
            onStatus("failed", error);
            return;
          }
        }
        if (controller.signal.aborted) return;
        onStatus("reconnecting");
        await sleep(delay);
        delay = Math.min(delay * 2, 3000);
      }
    };
    run();
    return subscription;
  }

  /**
   * Cancel the turn in flight: {cancelled: bool}. With `turnId`, only if that turn is
   * the one in flight (a stop pressed as its turn ends leaves the next turn alone).
   */
  cancel(name, { turnId = null } = {}) {
    const body = turnId === null ? undefined : { turn_id: turnId };
    return this.request("POST", this.sessionPath(name, "/cancel"), body);
  }

  /** Approve or deny a pending review; resolves to the turn's reply. */
  review(name, reviewId, approve, note = null) {
    return this.request("POST", this.sessionPath(name, `/reviews/${encodeURIComponent(reviewId)}`), {
      approve,
      note,
    });
  }

  /** Delete a session everywhere. */
  deleteSession(name) {
    return this.request("DELETE", this.sessionPath(name));
  }
}
