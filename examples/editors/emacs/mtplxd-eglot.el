;;; mtplxd-eglot.el --- mtplxd completions in Emacs through eglot  -*- lexical-binding: t; -*-

;; Load it from your init file: (load "/path/to/mtplxd-eglot.el")
;; Eglot (built into Emacs 29+, a package for 26.3+) does not do inline completion,
;; so the server offers `textDocument/completion': the suggestion is one candidate of
;; `completion-at-point' (C-M-i), and of company or corfu when they are on.
;; `mtplxd lsp' starts the daemon if none runs; every Emacs shares it.
;;
;; Eglot runs one server per major mode and project; this adds mtplxd for a few modes.
;; To run it beside another server for the same mode you need a multiplexer such as
;; rassumfrassum or lspx: eglot keeps one server per buffer.

(require 'eglot)

(defvar mtplxd-eglot-modes
  '(python-mode python-ts-mode js-mode js-ts-mode typescript-ts-mode
    rust-mode rust-ts-mode go-mode go-ts-mode c-mode c-ts-mode c++-mode c++-ts-mode)
  "Major modes whose buffers get mtplxd completions.")

(defvar mtplxd-eglot-options
  '(:mtplxd (:maxTokens 64 :debounceMs 120))
  "Sent as initializationOptions; see examples/editors/README.md for the keys.")

(add-to-list 'eglot-server-programs
             `(,mtplxd-eglot-modes . ("mtplxd" "lsp" :initializationOptions ,mtplxd-eglot-options)))

;; Settings after start-up (M-x eglot-signal-didChangeConfiguration after changing them):
(setq-default eglot-workspace-configuration '(:mtplxd (:enable t :maxTokens 64)))

;; Start it with M-x eglot in a buffer of one of those modes, or always:
;; (dolist (mode mtplxd-eglot-modes) (add-hook (intern (format "%s-hook" mode)) #'eglot-ensure))

(provide 'mtplxd-eglot)
;;; mtplxd-eglot.el ends here
