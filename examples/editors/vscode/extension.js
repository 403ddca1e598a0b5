// A generic LSP client for mtplxd: `mtplxd lsp` on stdio, for every file.
// vscode-languageclient 9 declares inline completion as a proposed feature
// (registerProposedFeatures); the server then offers textDocument/inlineCompletion and
// VS Code shows the suggestions as ghost text (Tab accepts).
'use strict';

const vscode = require('vscode');
const { LanguageClient, TransportKind } = require('vscode-languageclient/node');

let client;

function settings() {
  const c = vscode.workspace.getConfiguration('mtplxd');
  return {
    mtplxd: {
      enable: c.get('enable'),
      maxTokens: c.get('maxTokens'),
      debounceMs: c.get('debounceMs'),
      contextTokens: c.get('contextTokens'),
      workspaceContextTokens: c.get('workspaceContextTokens'),
    },
  };
}

async function activate(context) {
  const [command, ...args] = vscode.workspace.getConfiguration('mtplxd').get('command');
  const serverOptions = { command, args, transport: TransportKind.stdio };
  const clientOptions = {
    documentSelector: [{ scheme: 'file' }, { scheme: 'untitled' }],
    initializationOptions: settings(),
    outputChannelName: 'mtplxd',
  };
  client = new LanguageClient('mtplxd', 'mtplxd', serverOptions, clientOptions);
  client.registerProposedFeatures();
  context.subscriptions.push(
    vscode.workspace.onDidChangeConfiguration((event) => {
      if (client && event.affectsConfiguration('mtplxd')) {
        client.sendNotification('workspace/didChangeConfiguration', { settings: settings() });
      }
    }),
  );
  await client.start();
}

function deactivate() {
  return client ? client.stop() : undefined;
}

module.exports = { activate, deactivate };
