#!/usr/bin/env node
// A second AMQP 1.0 client for drgate's tests: rhea, the Node.js client many
// applications use (tests/interop).  Like lab/client.py it runs as a process
// and prints one JSON object on stdout:
//
//   node lab/rhea/client.js send URL ADDRESS [--count N (1)] [--shape SHAPE] [--prop K=V]...
//        [--prefix m] [--raw HEX] [--dynamic-target]
//     -> {"sent", "accepted", "rejected", "released", "modified", "errors", "target"}
//   node lab/rhea/client.js receive URL ADDRESS [--count N (0: until idle)] [--idle S] [--credit N]
//        [--browse] [--selector EXPR] [--outcome OUTCOME] [--dynamic-source]
//     -> {"attach": {...}, "error": null | {condition, description}, "messages": [...]}
//
// SHAPE: plain (a string amqp-value), multi-data (two data sections),
// null-value (an amqp-value null), footer (a data section and a footer),
// sequences (two amqp-sequence sections).  --raw HEX sends those bytes as
// the message, unchanged.  OUTCOME: accept (default), release, reject,
// failed (modified, delivery-failed), undeliverable (modified,
// delivery-failed and undeliverable-here), annotated (modified,
// delivery-failed, with message-annotations {x-drgate-note: "seen"}), none
// (leave unsettled until the connection closes).
'use strict';

const rhea = require('rhea');

function parse(argv) {
  const [command, url, address, ...rest] = argv;
  const opts = { command, url, address, props: {}, count: 0, idle: 2, credit: 100 };
  for (let i = 0; i < rest.length; i++) {
    const flag = rest[i];
    const value = () => rest[++i];
    switch (flag) {
      case '--count': opts.count = Number(value()); break;
      case '--idle': opts.idle = Number(value()); break;
      case '--credit': opts.credit = Number(value()); break;
      case '--shape': opts.shape = value(); break;
      case '--prefix': opts.prefix = value(); break;
      case '--raw': opts.raw = Buffer.from(value(), 'hex'); break;
      case '--selector': opts.selector = value(); break;
      case '--outcome': opts.outcome = value(); break;
      case '--browse': opts.browse = true; break;
      case '--dynamic-target': opts.dynamicTarget = true; break;
      case '--dynamic-source': opts.dynamicSource = true; break;
      case '--prop': {
        const [k, v] = value().split('=');
        opts.props[k] = /^-?\d+$/.test(v) ? Number(v) : v;
        break;
      }
      default: throw new Error(`unknown option ${flag}`);
    }
  }
  return opts;
}

function connect(url) {
  const u = new URL(url);
  const container = rhea.create_container({ id: 'drgate-rhea-interop' });
  const connection = container.connect({
    host: u.hostname, port: Number(u.port || 5672), reconnect: false,
  });
  return { container, connection };
}

function body(shape, n) {
  switch (shape || 'plain') {
    case 'plain': return `body-${n}`;
    case 'multi-data':
      return rhea.message.data_sections([Buffer.from(`first-${n}`), Buffer.from(`second-${n}`)]);
    case 'null-value': return null;
    case 'footer': return rhea.message.data_section(Buffer.from(`data-${n}`));
    case 'sequences': return rhea.message.sequence_sections([[1, 'a'], [2, 'b']]);
    default: throw new Error(`unknown shape ${shape}`);
  }
}

// What a test needs to know of a body: its kind and content, JSON-safe.
function describeBody(b) {
  if (b === undefined) return { kind: 'none' };
  if (b === null) return { kind: 'value', value: null };
  if (b && b.typecode !== undefined) {
    const kind = b.typecode === 0x75 ? 'data' : b.typecode === 0x76 ? 'sequence' : 'section';
    const content = b.multiple ? b.content : [b.content];
    return {
      kind, sections: content.length,
      content: content.map((c) => (Buffer.isBuffer(c) ? c.toString() : c)),
    };
  }
  if (Buffer.isBuffer(b)) return { kind: 'value', value: b.toString() };
  return { kind: 'value', value: b };
}

function errorOf(thing) {
  const e = thing && thing.error;
  if (!e) return null;
  return { condition: e.condition || null, description: e.description || String(e) };
}

function print(result) {
  process.stdout.write(`${JSON.stringify(result)}\n`);
}

function send(opts) {
  opts.count = opts.count || 1;
  const { container, connection } = connect(opts.url);
  const result = {
    sent: 0, accepted: 0, rejected: 0, released: 0, modified: 0, errors: [], target: null,
  };
  const target = opts.dynamicTarget ? { dynamic: true } : { address: opts.address };
  const sender = connection.open_sender({ target, autosettle: true });
  const settled = () => result.accepted + result.rejected + result.released + result.modified;
  const done = (ctx) => {
    if (settled() >= opts.count) { ctx.connection.close(); }
  };
  sender.on('sender_open', (ctx) => {
    const remote = ctx.sender.remote.attach && ctx.sender.remote.attach.target;
    result.target = remote ? (remote.address || null) : null;
  });
  sender.on('sendable', (ctx) => {
    while (ctx.sender.sendable() && result.sent < opts.count) {
      result.sent += 1;
      const n = result.sent;
      if (opts.raw) {
        ctx.sender.send(opts.raw, undefined, 0);
        continue;
      }
      const msg = {
        message_id: `${opts.prefix || 'm'}-${n}`,
        application_properties: { seq: n, ...opts.props },
        body: body(opts.shape, n),
      };
      if (opts.shape === 'footer') msg.footer = { 'x-checksum': `sum-${n}` };
      ctx.sender.send(msg);
    }
  });
  container.on('accepted', (ctx) => { result.accepted += 1; done(ctx); });
  container.on('released', (ctx) => { result.released += 1; done(ctx); });
  container.on('modified', (ctx) => { result.modified += 1; done(ctx); });
  container.on('rejected', (ctx) => {
    result.rejected += 1;
    const state = ctx.delivery.remote_state;
    if (state && state.error) result.errors.push(errorOf(state));
    done(ctx);
  });
  finish(container, connection, result, () => result);
}

function settle(delivery, outcome) {
  switch (outcome || 'accept') {
    case 'accept': delivery.accept(); break;
    case 'release': delivery.release(); break;
    case 'reject': delivery.reject({ condition: 'amqp:not-allowed', description: 'test' }); break;
    case 'failed': delivery.modified({ delivery_failed: true }); break;
    case 'undeliverable':
      delivery.modified({ delivery_failed: true, undeliverable_here: true }); break;
    case 'annotated':
      delivery.modified({ delivery_failed: true, message_annotations: { 'x-drgate-note': 'seen' } });
      break;
    case 'none': break;
    default: throw new Error(`unknown outcome ${outcome}`);
  }
}

function receive(opts) {
  const { container, connection } = connect(opts.url);
  const result = { attach: null, error: null, messages: [] };
  const source = opts.dynamicSource ? { dynamic: true } : { address: opts.address };
  if (opts.browse) source.distribution_mode = 'copy';
  if (opts.selector) source.filter = rhea.filter.selector(opts.selector);
  // With --count N the receiver grants exactly N credits, once: nothing
  // arrives after the Nth message (a message that did would come back to the
  // queue when the link closes, and count as a delivery).
  const receiver = connection.open_receiver({
    source, autoaccept: false, credit_window: opts.count ? 0 : opts.credit,
  });
  if (opts.count) receiver.add_credit(opts.count);
  let idle = null;
  const arm = () => {
    clearTimeout(idle);
    idle = setTimeout(() => connection.close(), opts.idle * 1000);
  };
  receiver.on('receiver_open', (ctx) => {
    const remote = ctx.receiver.remote.attach && ctx.receiver.remote.attach.source;
    result.attach = remote ? {
      address: remote.address || null,
      distribution_mode: remote.distribution_mode || null,
      filter: remote.filter ? Object.keys(remote.filter) : null,
    } : null;
    arm();
  });
  receiver.on('message', (ctx) => {
    const m = ctx.message;
    result.messages.push({
      id: m.message_id === undefined ? null : String(m.message_id),
      properties: m.application_properties || {},
      delivery_count: m.delivery_count || 0,
      first_acquirer: m.first_acquirer || false,
      annotations: m.message_annotations || {},
      footer: m.footer || null,
      body: describeBody(m.body),
    });
    settle(ctx.delivery, opts.outcome);
    if (opts.count && result.messages.length >= opts.count) {
      ctx.connection.close();
    } else {
      arm();
    }
  });
  finish(container, connection, result, () => { clearTimeout(idle); return result; });
}

function finish(container, connection, result, final) {
  const fail = (ctx, what) => {
    const thing = ctx.receiver || ctx.sender || ctx.connection;
    if (!result.error) result.error = errorOf(thing) || { condition: null, description: what };
    ctx.connection.close();
  };
  container.on('receiver_error', (ctx) => fail(ctx, 'receiver error'));
  container.on('sender_error', (ctx) => fail(ctx, 'sender error'));
  container.on('connection_error', (ctx) => fail(ctx, 'connection error'));
  container.on('error', (err) => {
    if (!result.error) result.error = { condition: null, description: String(err) };
  });
  container.on('disconnected', (ctx) => {
    if (ctx.error && !result.error) result.error = { condition: null, description: String(ctx.error) };
    print(final());
    process.exit(0);
  });
  container.on('connection_close', () => {
    print(final());
    process.exit(0);
  });
  connection.on('connection_open', () => {});
}

const opts = parse(process.argv.slice(2));
if (opts.command === 'send') send(opts);
else if (opts.command === 'receive') receive(opts);
else {
  process.stderr.write(`usage: client.js send|receive URL ADDRESS [options]\n`);
  process.exit(2);
}
