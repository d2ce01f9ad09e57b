// The official MCP TypeScript SDK (npm @modelcontextprotocol/sdk) as a real client of the gateway.
//
//     node driver.mjs URL
//
// connects with the SDK's Client and StreamableHTTPClientTransport to URL (an MCP route through
// Envoy and the filter), runs the scenarios of tests/tests/mcp_sdk.rs and prints one JSON line per
// step: {sdk, step, ok, error, isError, status, structuredContent, meta, content, ...}.
// `ok` is false when the SDK threw (then `error` is the error's name, code and message).
//
// Output-schema validation is the SDK's default: Client.callTool validates structuredContent
// against the outputSchema of every tool it has listed (listTools() caches the validators; a
// tool never listed is not validated), on error results too when they carry structuredContent.
// So every agent here lists the tools first, and the step `validation_armed` proves the
// validator is in place. Nothing here judges the answers: the Rust test does.

import { readFileSync } from 'node:fs';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const REPLY_META = 'agent-idempotency/reply';
const ALICE = 'user-alice';
const BOB = 'user-bob';
const SDK_VERSION = JSON.parse(
  readFileSync(new URL('./node_modules/@modelcontextprotocol/sdk/package.json', import.meta.url), 'utf8'),
).version;

function emit(step, fields) {
  const line = { sdk: 'node', step, ...fields };
  process.stdout.write(JSON.stringify(line) + '\n');
}

function describe(result) {
  const meta = result._meta ?? null;
  const structured = result.structuredContent ?? null;
  const envelope = meta && typeof meta === 'object' ? meta[REPLY_META] : undefined;
  let status = null;
  if (envelope && typeof envelope === 'object') status = envelope.status ?? null;
  else if (structured && typeof structured === 'object') status = structured.status ?? null;
  return {
    ok: true,
    error: null,
    isError: Boolean(result.isError),
    status,
    structuredContent: structured,
    meta,
    content: result.content ?? [],
  };
}

function failure(e) {
  const code = e && e.code !== undefined ? ` (code ${e.code})` : '';
  return {
    ok: false,
    error: `${e?.name ?? 'Error'}${code}: ${e?.message ?? String(e)}`,
    isError: null,
    status: null,
    structuredContent: null,
    meta: null,
    content: null,
  };
}

class Agent {
  constructor(url, headers) {
    this.transport = new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers } });
    this.client = new Client({ name: 'idem-e2e-node', version: '0.1.0' });
  }

  // initialize + notifications/initialized, then tools/list (which arms the output validators).
  async connect() {
    await this.client.connect(this.transport);
    return this.client.listTools();
  }

  async call(name, args) {
    try {
      return describe(await this.client.callTool({ name, arguments: args }));
    } catch (e) {
      return failure(e);
    }
  }

  close() {
    return this.client.close();
  }
}

function transfer(amount, memo, fingerprint) {
  const args = { amount, currency: 'EUR', payee_id: 'payee-42', memo };
  if (fingerprint !== undefined) args.fingerprint = fingerprint;
  return args;
}

// The same length, one character in the middle changed: a signature that cannot verify.
function garble(fp) {
  const i = Math.floor(fp.length / 2);
  return fp.slice(0, i) + (fp[i] !== 'A' ? 'A' : 'B') + fp.slice(i + 1);
}

async function quote(agent, step, amount, memo) {
  const answer = await agent.call('quote_transfer', transfer(amount, memo));
  const sc = answer.structuredContent;
  const fingerprint = sc && typeof sc.fingerprint === 'string' ? sc.fingerprint : null;
  emit(step, { fingerprint, ...answer });
  return fingerprint;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function main(url) {
  const headers = { 'x-agent-subject': ALICE };
  const alice = new Agent(url, headers);
  try {
    await alice.client.connect(alice.transport);
    emit('initialize', {
      ok: true,
      error: null,
      protocolVersion: alice.transport.protocolVersion ?? null,
      server: alice.client.getServerVersion()?.name ?? null,
      sdk_version: `@modelcontextprotocol/sdk ${SDK_VERSION}`,
    });
  } catch (e) {
    emit('initialize', failure(e));
    return;
  }
  try {
    const listed = await alice.client.listTools();
    const tools = Object.fromEntries(listed.tools.map((t) => [t.name, t.outputSchema !== undefined]));
    const schemas = Object.fromEntries(listed.tools.map((t) => [t.name, t.outputSchema ?? null]));
    emit('list_tools', { ok: true, error: null, tools, schemas });
  } catch (e) {
    emit('list_tools', failure(e));
    return;
  }

  // Validation is on in this client: the validator callTool uses for execute_transfer (cached by
  // listTools) refuses a structuredContent that is not a transfer record.
  const validator = alice.client.getToolOutputValidator('execute_transfer');
  if (typeof validator !== 'function') {
    emit('validation_armed', { ok: false, error: 'no output validator cached for execute_transfer' });
  } else {
    const verdict = validator({ status: 'already_completed' });
    emit('validation_armed', verdict.valid
      ? { ok: false, error: 'the SDK accepted a structuredContent its schema forbids' }
      : { ok: true, error: verdict.errorMessage });
  }

  // The agent flow: quote, execute, a retry with a drifted memo, the status tool.
  const fp = await quote(alice, 'quote', '12.50', 'rent');
  if (fp === null) return;
  emit('execute', await alice.call('execute_transfer', transfer(12.5, 'rent, ASAP', fp)));
  emit('replay', await alice.call('execute_transfer', transfer('12.50', 'please rent ASAP', fp)));
  emit('status_done', await alice.call('get_transfer_status', { fingerprint: fp }));

  // Refusals: nothing executes.
  emit('params_changed', await alice.call('execute_transfer', transfer('4000.00', 'rent', fp)));
  emit('fingerprint_missing', await alice.call('execute_transfer', transfer('12.50', 'rent')));
  emit('fingerprint_invalid', await alice.call('execute_transfer', transfer('12.50', 'rent', garble(fp))));
  const bob = new Agent(url, { 'x-agent-subject': BOB });
  await bob.connect();
  emit('forbidden', await bob.call('execute_transfer', transfer('12.50', 'rent', fp)));
  await bob.close();

  // A duplicate while the first call is still executing (the demo holds it 4 s).
  const fp2 = await quote(alice, 'quote_slow', '20.00', 'slow');
  const slow = new Agent(url, { ...headers, 'x-demo-delay-ms': '4000' });
  await slow.connect();
  const first = slow.call('execute_transfer', transfer('20.00', 'slow', fp2));
  // Wait until the gateway holds the operation (its status tool says so), then duplicate.
  let polled = null;
  for (let i = 0; i < 60; i++) {
    await sleep(100);
    polled = await alice.call('get_transfer_status', { fingerprint: fp2 });
    if (polled.status === 'in_progress') break;
    if (!polled.ok) {
      await sleep(1000); // the SDK refused the report: give the first call time to land
      break;
    }
  }
  emit('status_in_flight', polled);
  emit('in_progress', await alice.call('execute_transfer', transfer('20.00', 'slow again', fp2)));
  emit('execute_slow', await first);
  await slow.close();

  // The upstream answers the MCP POST with HTTP 503 (demo: x-demo-fail): released, then a retry runs once.
  const fp3 = await quote(alice, 'quote_503', '30.00', 'flaky');
  const flaky = new Agent(url, { ...headers, 'x-demo-fail': '503' });
  await flaky.connect();
  emit('not_executed', await flaky.call('execute_transfer', transfer('30.00', 'flaky', fp3)));
  await flaky.close();
  emit('execute_after_503', await alice.call('execute_transfer', transfer('30.00', 'flaky', fp3)));

  // The upstream's own refusal (over the demo's limit) makes a FAILED operation; a retry is already_failed.
  const fp5 = await quote(alice, 'quote_over_limit', '20000.00', 'too much');
  emit('execute_over_limit', await alice.call('execute_transfer', transfer('20000.00', 'too much', fp5)));
  emit('replay_failed', await alice.call('execute_transfer', transfer('20000.00', 'too much', fp5)));
  emit('status_failed', await alice.call('get_transfer_status', { fingerprint: fp5 }));

  // A server that leaves its outputSchema (demo: x-demo-off-schema): the SDK's validation acts through the
  // gateway, and a FAILED operation recorded from such an answer replays without its structuredContent.
  const careless = new Agent(url, { ...headers, 'x-demo-off-schema': '1' });
  await careless.connect();
  emit('off_schema_quote', await careless.call('quote_transfer', transfer('50.00', 'careless')));
  const fp6 = await quote(alice, 'quote_off_schema', '30000.00', 'careless');
  emit('execute_off_schema', await careless.call('execute_transfer', transfer('30000.00', 'careless', fp6)));
  await careless.close();
  emit('replay_failed_off_schema', await alice.call('execute_transfer', transfer('30000.00', 'careless', fp6)));

  // The status tool on a fingerprint never used.
  const fp4 = await quote(alice, 'quote_unused', '40.00', 'unused');
  emit('status_not_yet', await alice.call('get_transfer_status', { fingerprint: fp4 }));

  // The route's approval rule (amount 7777.77): approval_required, then the status tool says it waits.
  const fp7 = await quote(alice, 'quote_approval', '7777.77', 'needs a person');
  emit('execute_approval', await alice.call('execute_transfer', transfer('7777.77', 'needs a person', fp7)));
  emit('status_approval', await alice.call('get_transfer_status', { fingerprint: fp7 }));
  await alice.close();
  emit('done', { ok: true, error: null });
}

if (process.argv.length !== 3) {
  console.error('usage: node driver.mjs URL');
  process.exit(2);
}
main(process.argv[2]).catch((e) => {
  emit('driver', { ok: false, error: e?.stack ?? String(e) });
  process.exitCode = 1;
});
