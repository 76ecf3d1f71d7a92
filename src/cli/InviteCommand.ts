/**
 * `swactor invite` (issue 39): prints one line, an invite (src/domain/invite.ts) holding the address to join (this
 * host's LAN address and discovery port, or --address) and the cluster token (--token-file, else
 * SWACTOR_CLUSTER_TOKEN, as the other commands read it). `swactor node --join <invite>` needs nothing else. The token is
 * printed inside the invite only: keep the line as secret as the token.
 */
import * as Command from "@effect/cli/Command"
import { Console, Effect, Option } from "effect"
import { encodeInvite } from "../domain/invite.js"
import { parseAddress } from "../layers/agent/AgentControlRpc.js"
import { Settings } from "../layers/config/Settings.js"
import { inviteAddress } from "./DiscoverAgents.js"
import { UsageError } from "./Flags.js"
import * as Flag from "./FlagSpec.js"
import { commandDoc, optionsOf } from "./FlagSpec.js"
import { clusterToken, securityFlags } from "./PipelineFlags.js"

const group = "Invite"

const inviteFlags = {
  address: Flag.text("address", {
    group,
    value: "HOST:PORT",
    text: "the discovery address a joining node sends to: an orchestrator's (serve --discover) or a pool node's"
  }).optional("this host's first LAN address, the discovery port (SWACTOR_DISCOVERY_PORT)"),
  tokenFile: securityFlags.tokenFile
}

type InviteArgs = Flag.ArgsOf<typeof inviteFlags>

const runInvite = (args: InviteArgs) =>
  Effect.gen(function* () {
    const token = yield* clusterToken(args.tokenFile)
    if (token === "")
      return yield* new UsageError({ message: "no cluster token: set SWACTOR_CLUSTER_TOKEN or pass --token-file" })
    const settings = yield* Settings
    const address = Option.isSome(args.address) ? args.address.value.trim() : inviteAddress(settings)
    const parsed = parseAddress(address)
    if (parsed?._tag !== "Tcp" || parsed.port === 0)
      return yield* new UsageError({ message: `--address "${address}" is not host:port` })
    yield* Console.log(encodeInvite({ address, token }))
  }).pipe(Effect.tapError((error) => Console.error(`swactor invite: ${error.message}`)))

/** What `swactor invite --help` says. */
export const inviteDoc = commandDoc(
  "invite",
  "Print an invite (an address to join and the cluster token) for swactor node --join",
  [group, "Network and security"],
  inviteFlags,
  [
    {
      what: "an invite to this host's discovery port, the token in a file",
      command: "swactor invite --token-file token"
    },
    {
      what: "on the other machine",
      command: "swactor node --listen 0.0.0.0:7070 --join swactor1:..."
    }
  ]
)

export const inviteCommand = Command.make("invite", optionsOf(inviteFlags), runInvite).pipe(
  Command.withDescription(inviteDoc.summary)
)
