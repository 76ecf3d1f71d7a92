// Invites (issue 39): `swactor1:` then base64url of the address and the token. Encoded and decoded back; anything
// else refused with why, never quoting the string (it may hold a token). Through the real program: `swactor invite`
// prints one that decodes to the address and the token it read; `swactor node --join` refuses a malformed invite in
// one line that does not repeat it, and a host:port that is neither. Needs dist/ (npm run build).
import { assert, describe, it } from "@effect/vitest"
import { execFile } from "node:child_process"
import { Effect, Either, Encoding } from "effect"
import { decodeInvite, encodeInvite } from "../../src/domain/invite.js"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { repoRoot, requireModel } from "../support/models.js"

const swactor = (args: ReadonlyArray<string>, env: Record<string, string | undefined>) =>
  Effect.async<{ code: number; stdout: string; stderr: string }>((resume) => {
    execFile(
      process.execPath,
      [swactorMain(), ...args],
      { cwd: repoRoot, env: { ...process.env, SWACTOR_CLUSTER_TOKEN: undefined, ...env }, timeout: 30_000 },
      (error, stdout, stderr) =>
        resume(Effect.succeed({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr }))
    )
  })

describe("invites", () => {
  it("round-trips an address and a token; refuses what is not an invite, saying why", () => {
    const invite = { address: "10.0.0.7:41739", token: "5c2ff2621ca7dbcfd06d77e42cd28b84" }
    const text = encodeInvite(invite)
    assert.match(text, /^swactor1:[A-Za-z0-9_-]+$/)
    assert.deepStrictEqual(decodeInvite(text), Either.right(invite))
    const why = (s: string) => Either.match(decodeInvite(s), { onLeft: (w) => w, onRight: () => "decoded" })
    assert.strictEqual(why("10.0.0.7:41739"), "it does not start with swactor1:")
    assert.strictEqual(why("swactor1:not base64!"), "its payload is not base64url")
    assert.strictEqual(
      why(`swactor1:${Encoding.encodeBase64Url('{"a":1}')}`),
      "its payload is not an invite's (an address and a token)"
    )
    assert.strictEqual(why(encodeInvite({ ...invite, address: "10.0.0.7" })), "its address is not host:port")
    assert.strictEqual(why(encodeInvite({ ...invite, address: "10.0.0.7:0" })), "its address is not host:port")
  })

  it.live(
    "swactor invite prints one that holds its address and token; node --join refuses a bad one in one line",
    () =>
      Effect.gen(function* () {
        const token = generateToken()
        const printed = yield* swactor(["invite", "--address", "192.0.2.9:41739"], { SWACTOR_CLUSTER_TOKEN: token })
        assert.strictEqual(printed.code, 0, printed.stderr)
        assert.deepStrictEqual(decodeInvite(printed.stdout.trim()), Either.right({ address: "192.0.2.9:41739", token }))
        assert.strictEqual(printed.stdout.split("\n").length, 2)
        const none = yield* swactor(["invite"], {})
        assert.strictEqual(none.code, 1)
        assert.strictEqual(none.stderr.trim().split("\n").length, 1)

        const secretish = "swactor1:c2VjcmV0LXRva2VuLWluLWEtYnJva2VuLWludml0ZQ" // not an invite's JSON
        const bad = yield* swactor(["node", "--engine", "test", "--join", secretish], { SWACTOR_CLUSTER_TOKEN: token })
        assert.strictEqual(bad.code, 1)
        assert.strictEqual(
          bad.stderr,
          "swactor node: --join: not a valid invite: its payload is not an invite's (an address and a token)\n"
        )
        assert.notInclude(bad.stderr + bad.stdout, "c2VjcmV0")
        const weak = encodeInvite({ address: "127.0.0.1:41739", token: "aaaaaaaaaaaaaaaaaaaa" })
        const refusedWeak = yield* swactor(["node", "--engine", "test", "--join", weak], {})
        assert.strictEqual(refusedWeak.code, 1)
        assert.match(refusedWeak.stderr, /^swactor node: --join: the cluster token from the invite is weak/)
        assert.notInclude(refusedWeak.stderr, "aaaaaaaaaaaaaaaa")
        const notAddress = yield* swactor(["node", "--engine", "test", "--join", "nowhere"], {
          SWACTOR_CLUSTER_TOKEN: token
        })
        assert.strictEqual(notAddress.stderr, "swactor node: --join: not host:port nor an invite (swactor1:...)\n")
      }),
    60_000
  )

  it.live(
    "serve --discover prints its invite (this host's address, the discovery port, the token) while it listens",
    () =>
      Effect.gen(function* () {
        const token = generateToken()
        const port = String(20000 + ((process.pid + 29) % 20000))
        const served = yield* swactor(
          ["serve", "--model", requireModel("stories260K.gguf"), "--port", "0", "--discover"],
          { SWACTOR_CLUSTER_TOKEN: token, SWACTOR_DISCOVERY_PORT: port }
        )
        // no node answers: it says so and exits 1, after the invite line
        assert.strictEqual(served.code, 1)
        const line = served.stderr.split("\n").find((l) => l.startsWith("swactor: invite"))
        assert.isDefined(line, served.stderr)
        const invite = decodeInvite(line!.slice(line!.indexOf("swactor1:")))
        assert.isTrue(Either.isRight(invite))
        assert.match(Either.getOrThrow(invite).address, new RegExp(`^[\\d.]+:${port}$`))
        assert.strictEqual(Either.getOrThrow(invite).token, token)
        assert.strictEqual(served.stderr.split(token).length, 1)
      }),
    60_000
  )
})
